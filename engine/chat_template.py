"""A checkpoint's chat template: the Jinja program that turns a list of messages into the prompt text.

Rendered the way Hugging Face's ``apply_chat_template`` renders it (a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the
``raise_exception`` helper, the special tokens as variables), so a template
written for transformers gives the same text here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict


class Message(TypedDict):
    """One chat turn: ``role`` is ``system``, ``user`` or ``assistant``."""

    role: str
    content: str


class ChatTemplateError(ValueError):
    """A chat template does not compile, or rejects the messages it was given."""


class ChatTemplate:
    """A compiled chat template; ``source`` names where it came from in errors."""

    def __init__(self, template: str, *, bos_token: str = "", eos_token: str = "", source: str = "template") -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(f"{source}: chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(template)
        except TemplateError as exc:
            raise ChatTemplateError(f"{source}: chat template does not compile: {exc}") from exc
        self.source = source
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages``; with ``add_generation_prompt`` it ends where the assistant's reply starts."""
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **extra)
        except TemplateError as exc:
            raise ChatTemplateError(f"{self.source}: chat template failed: {exc}") from exc

    def user_prompt(self, text: str) -> str:
        """The prompt for a single user message, ready for the assistant's reply."""
        return self.render([{"role": "user", "content": text}])
