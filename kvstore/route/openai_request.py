"""OpenAI completion and chat requests: the fields kvstore's engine server and router read, checked.

One parser for both sides: the engine server (``kvstore engine serve``) runs
what it parses, the router (``kvstore route``) tokenizes the same prompt to
compute block keys, so the two cannot disagree on what a request means.
Unknown fields are ignored (clients send many); fields kvstore cannot honour
(``n`` > 1, ``logprobs``, ``echo``) are refused, as is a field of the wrong
type, with a :class:`RequestError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

RequestKind = Literal["completion", "chat"]

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for completions; used for chat too (the engine needs a bound)."""


class RequestError(ValueError):
    """A request body kvstore cannot run; ``param`` names the field (OpenAI's ``error.param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn with its text content (text parts of a list content are joined)."""

    role: str
    content: str


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed ``/v1/completions`` (``prompt``) or ``/v1/chat/completions`` (``messages``) body."""

    kind: RequestKind
    prompt: str | tuple[int, ...] | None
    """The completion prompt: text or token ids (None for chat)."""
    messages: tuple[ChatMessage, ...] | None
    """The chat history (None for completions)."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    """``stream_options.include_usage``: a last chunk carries the usage."""
    ignore_eos: bool = False
    cache_salt: str | None = None
    """Tenant salt of the prefix cache (vLLM's ``cache_salt``): requests share cached blocks only under one salt."""
    model: str | None = None


_ROLES = ("system", "user", "assistant", "tool", "developer")


def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise RequestError(name, f"'{name}' must be {what}, got {value!r}")
    if not isinstance(value, kinds):
        raise RequestError(name, f"'{name}' must be {what}, got {type(value).__name__} {value!r}"[:200])
    return value


def _prompt(body: dict[str, Any]) -> str | tuple[int, ...]:
    if "prompt" not in body or body["prompt"] is None:
        raise RequestError("prompt", "'prompt' is required (a string or a list of token ids)")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "'prompt' is empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise RequestError("prompt", "'prompt' token ids must not be negative")
        return tuple(prompt)
    raise RequestError("prompt", "'prompt' must be one string or one non-empty list of token ids "
                       "(batches of several prompts are not supported)")


def _content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content[{j}]",
                                   f"'messages[{i}].content[{j}]' must be a text part "
                                   "({'type': 'text', 'text': ...}); other parts are not supported")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content", f"'messages[{i}].content' must be a string or a list of text parts")


def _messages(body: dict[str, Any]) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "'messages' is required: a non-empty list of {'role', 'content'} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}]", f"'messages[{i}]' must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in _ROLES:
            raise RequestError(f"messages[{i}].role", f"'messages[{i}].role' must be one of {list(_ROLES)}, "
                               f"got {role!r}")
        out.append(ChatMessage(role, _content(i, m.get("content"))))
    return tuple(out)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise RequestError("stop", "'stop' must be a string or a list of strings")


def parse_request(kind: RequestKind, body: Any) -> CompletionRequest:
    """The request ``body`` (decoded JSON) means; raises :class:`RequestError` naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError(None, "the request body must be a JSON object")
    n = _typed(body, "n", (int,), 1, "an integer")
    if n != 1:
        raise RequestError("n", f"'n' must be 1 (one completion per request), got {n}")
    if body.get("logprobs") not in (None, False):
        raise RequestError("logprobs", "'logprobs' is not supported")
    if body.get("echo") not in (None, False):
        raise RequestError("echo", "'echo' is not supported")
    limit_name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _typed(body, limit_name, (int,), DEFAULT_MAX_TOKENS, "a positive integer")
    if max_tokens <= 0:
        raise RequestError(limit_name, f"'{limit_name}' must be a positive integer, got {max_tokens}")
    temperature = float(_typed(body, "temperature", (int, float), 1.0, "a number"))
    if temperature < 0:
        raise RequestError("temperature", f"'temperature' must not be negative, got {temperature}")
    top_p = float(_typed(body, "top_p", (int, float), 1.0, "a number"))
    if not 0 < top_p <= 1:
        raise RequestError("top_p", f"'top_p' must be in (0, 1], got {top_p}")
    top_k = _typed(body, "top_k", (int,), 0, "an integer")
    if top_k < -1:
        raise RequestError("top_k", f"'top_k' must be 0 or -1 (off) or positive, got {top_k}")
    options = _typed(body, "stream_options", (dict,), {}, "an object")
    salt = _typed(body, "cache_salt", (str,), None, "a string")
    model = _typed(body, "model", (str,), None, "a string")
    return CompletionRequest(
        kind=kind,
        prompt=_prompt(body) if kind == "completion" else None,
        messages=_messages(body) if kind == "chat" else None,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        seed=_typed(body, "seed", (int,), None, "an integer"),
        stop=_stop(body),
        stream=_typed(body, "stream", (bool,), False, "true or false"),
        include_usage=bool(options.get("include_usage", False)),
        ignore_eos=_typed(body, "ignore_eos", (bool,), False, "true or false"),
        cache_salt=salt or None,
        model=model,
    )
