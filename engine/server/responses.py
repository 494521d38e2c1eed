"""OpenAI response bodies: completion and chat, whole or as SSE chunks, with ``usage``.

``usage.prompt_tokens_details.cached_tokens`` is what OpenAI and vLLM report:
the prompt tokens served from the prefix cache, i.e. not recomputed here.
"""

from __future__ import annotations

import json
import time
from typing import Any

from engine.server.worker import Usage
from kvstore.route.openai_request import RequestKind


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class ResponseWriter:
    """Builds the bodies of one response (id, model, kind fixed at construction)."""

    def __init__(self, kind: RequestKind, request_id: str, model: str) -> None:
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str | None, usage: Usage) -> dict[str, Any]:
        """A non-streaming response."""
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": finish_reason, "logprobs": None}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            body = self._head("text_completion")
        return {**body, "choices": [choice], "usage": usage_body(usage)}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> bytes:
        """One SSE event carrying ``text`` (the chat stream's first one also carries the role)."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            body = self._head("text_completion")
        return sse({**body, "choices": [choice]})

    def usage_chunk(self, usage: Usage) -> bytes:
        """The stream's last event under ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": usage_body(usage)})


def sse(obj: Any) -> bytes:
    """One server-sent event with ``obj`` as JSON data."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
"""The event that ends an OpenAI stream."""
