"""From an OpenAI request to the token ids the engine runs: the chat template, then the tokenizer.

The engine server and the router (which hashes the same ids into block keys)
both call :meth:`PromptRenderer.token_ids`, so a replica caches exactly the
blocks the router predicts.
"""

from __future__ import annotations

from engine.chat_template import ChatTemplate, Message
from engine.model_text import ModelText
from kvstore.route.openai_request import CompletionRequest, RequestError

FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The template of a model without one (the built-in model, a checkpoint directory): role-tagged turns."""


class PromptRenderer:
    """Renders chat requests with the model's template (or :data:`FALLBACK_CHAT_TEMPLATE`) and tokenizes."""

    def __init__(self, text: ModelText) -> None:
        self.tokenizer = text.tokenizer
        self.chat_template = text.chat_template or ChatTemplate(
            FALLBACK_CHAT_TEMPLATE, source="kvstore's fallback chat template (the model has none)")

    def token_ids(self, request: CompletionRequest) -> list[int]:
        """The prompt's token ids. Raises :class:`RequestError` naming the field the template refused."""
        if request.kind == "chat":
            assert request.messages is not None  # parse_request guarantees it for chat
            messages: list[Message] = [{"role": m.role, "content": m.content} for m in request.messages]
            try:
                text = self.chat_template.render(messages)
            except ValueError as exc:  # ChatTemplateError: the template rejects these messages
                raise RequestError("messages", str(exc)) from exc
            return self.tokenizer.encode(text)
        assert request.prompt is not None
        if isinstance(request.prompt, str):
            return self.tokenizer.encode(request.prompt)
        return list(request.prompt)
