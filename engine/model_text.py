"""A model's text side: its tokenizer and chat template, loadable without the weights.

``LLM`` takes both from here, and so does a process that only needs to turn
requests into the token ids the engine will see (``kvstore route`` computing
block keys), so the two always tokenize alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.chat_template import ChatTemplate, chat_template_from_checkpoint
from engine.config import ModelArch
from engine.gguf_file import GGUFFile
from engine.gguf_loader import checkpoint_config, is_gguf_path
from engine.gguf_tokenizer import chat_template_from_gguf, tokenizer_from_gguf
from engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


@dataclass(frozen=True)
class ModelText:
    """How text becomes token ids for one model: the tokenizer, and the chat template when the model has one."""

    tokenizer: ByteTokenizer | HFTokenizer
    chat_template: ChatTemplate | None


def model_text(model: str | Path | None, arch: ModelArch, gguf: GGUFFile | None = None) -> ModelText:
    """The text side of ``model`` (a checkpoint directory, a ``.gguf`` file, or None for the built-in model).

    ``arch`` is the model's configuration (its vocabulary sizes the byte
    tokenizer's check); ``gguf`` is the already opened file when ``model`` is
    one. A GGUF file carries its tokenizer and template; a checkpoint directory
    its ``tokenizer.json`` and, where transformers keeps it, its template
    (``chat_template.jinja`` or ``tokenizer_config.json``); the built-in model
    the byte tokenizer.
    """
    if model is not None and gguf is None and is_gguf_path(model):
        gguf = GGUFFile(model)
    if gguf is not None:
        return ModelText(HFTokenizer(backend=tokenizer_from_gguf(gguf)), chat_template_from_gguf(gguf))
    template = chat_template_from_checkpoint(model) if model is not None and Path(model).is_dir() else None
    return ModelText(load_tokenizer(model, arch.vocab_size), template)


def load_model_text(model: str | Path | None) -> ModelText:
    """:func:`model_text` of ``model`` with its configuration read from its files (no weights loaded)."""
    if model is None:
        return model_text(None, ModelArch.tiny())
    gguf = GGUFFile(model) if is_gguf_path(model) else None
    return model_text(model, checkpoint_config(model, gguf), gguf)
