"""A checkpoint's chat template: the Jinja program that turns a list of messages into the prompt text.

Rendered the way Hugging Face's ``apply_chat_template`` renders it (a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the
``raise_exception`` helper, the special tokens as variables), so a template
written for transformers gives the same text here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
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


def chat_template_from_checkpoint(directory: str | Path) -> ChatTemplate | None:
    """A Hugging Face checkpoint directory's chat template, where transformers looks for it: ``chat_template.jinja``,
    else ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates: the ``default`` one), with the
    BOS/EOS strings of ``tokenizer_config.json``. ``None`` when it has none. A router that tokenizes chats for vLLM
    replicas of such a checkpoint must render them exactly as vLLM does, which uses this template."""
    import json

    root = Path(directory)
    cfg_path = root / "tokenizer_config.json"
    try:
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"{cfg_path}: not readable JSON: {exc}") from exc
    jinja = root / "chat_template.jinja"
    template: Any = jinja.read_text() if jinja.is_file() else cfg.get("chat_template")
    source = str(jinja) if jinja.is_file() else f"{cfg_path}: chat_template"
    if isinstance(template, list):  # named templates
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(template, str) or not template:
        return None

    def token(name: str) -> str:
        value = cfg.get(name)
        if isinstance(value, dict):  # an AddedToken written out
            value = value.get("content")
        return value if isinstance(value, str) else ""

    return ChatTemplate(template, bos_token=token("bos_token"), eos_token=token("eos_token"), source=source)
