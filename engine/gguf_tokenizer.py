"""A GGUF file's byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``), rebuilt with ``tokenizers``.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, the merges,
each token's type and the special token ids as metadata, plus the name of the
pre-tokenizer (``tokenizer.ggml.pre``) whose text splitting the merges were
learned with. The splits here are llama.cpp's for those names.
"""

from __future__ import annotations

from typing import Any

from engine.chat_template import ChatTemplate
from engine.config import CheckpointError
from engine.gguf_file import GGUFFile

#: llama.cpp token types (``tokenizer.ggml.token_type``).
CONTROL = 3
USER_DEFINED = 4

#: ``tokenizer.ggml.pre`` -> whether digits are split one by one before GPT-2's byte-level regex
#: (StarCoder-lineage vocabularies, such as SmolLM's, learned their merges on single digits).
PRE_TOKENIZERS: dict[str, bool] = {
    "default": False,
    "gpt2": False,
    "smollm": True,
    "starcoder": True,
}


def tokenizer_from_gguf(gguf: GGUFFile) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to the one the metadata describes.

    Control tokens (``<|im_start|>`` ...) are special: matched whole in the
    text and dropped when decoding with ``skip_special_tokens``. The BOS id is
    prepended when ``tokenizer.ggml.add_bos_token`` says so. Raises
    :class:`CheckpointError` naming the key for a tokenizer model or
    pre-tokenizer this engine does not rebuild.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = gguf.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{gguf.path}: tokenizer.ggml.model {kind!r} is not supported (only byte-level "
                              f"BPE, 'gpt2')")
    pre = gguf.field("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{gguf.path}: tokenizer.ggml.pre {pre!r} is not supported; "
                              f"supported: {sorted(PRE_TOKENIZERS)}")
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if PRE_TOKENIZERS[pre] else byte_level)
    tok.decoder = decoders.ByteLevel()
    types: list[int] = gguf.field("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == USER_DEFINED])
    bos = gguf.field("tokenizer.ggml.bos_token_id")
    if gguf.field("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A",
                                                           special_tokens=[(tokens[bos], bos)])
    return tok


def chat_template_from_gguf(gguf: GGUFFile) -> ChatTemplate | None:
    """The file's ``tokenizer.chat_template`` compiled, with its BOS/EOS strings; ``None`` when it has none."""
    template = gguf.field("tokenizer.chat_template")
    if template is None:
        return None
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    bos, eos = (gguf.field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
    return ChatTemplate(template, bos_token=tokens[bos] if bos is not None else "",
                        eos_token=tokens[eos] if eos is not None else "",
                        source=f"{gguf.path}: tokenizer.chat_template")
