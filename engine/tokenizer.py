"""Tokenizers: a built-in byte-level one, and a checkpoint's ``tokenizer.json`` through ``tokenizers``.

The byte tokenizer maps each UTF-8 byte to its value (0-255) and reserves 256
for beginning-of-sequence and 257 for end-of-sequence, so any model with a
vocabulary of at least 258 can be driven by text with no files at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from engine.config import CheckpointError


class Tokenizer(Protocol):
    """Text to token ids and back."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with the beginning-of-sequence token when the tokenizer uses one."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``; special tokens are dropped."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus BOS (256) and EOS (257)."""

    BOS = 256
    EOS = 257
    VOCAB_SIZE = 258

    def __init__(self, add_bos: bool = True) -> None:
        self.add_bos = add_bos

    def encode(self, text: str) -> list[int]:
        """``[BOS] + bytes`` of the UTF-8 encoding."""
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if self.add_bos else ids

    def decode(self, token_ids: list[int]) -> str:
        """Bytes below 256, decoded as UTF-8 (an incomplete sequence becomes U+FFFD)."""
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers`` library tokenizer: a ``tokenizer.json`` file, or one built in memory (``backend``).

    Raises :class:`CheckpointError` naming the file when ``path`` cannot be parsed.
    """

    def __init__(self, path: str | Path | None = None, *, backend: Any = None) -> None:
        if (path is None) == (backend is None):
            raise ValueError("HFTokenizer takes either a tokenizer.json path or a backend tokenizer")
        if backend is None:
            from tokenizers import Tokenizer as _Tokenizer

            try:
                backend = _Tokenizer.from_file(str(path))
            except Exception as exc:
                # ``tokenizers`` raises a bare Exception for unparsable or unknown-format files.
                raise CheckpointError(f"{path}: not a valid tokenizer.json ({exc})") from exc
        self._tok = backend

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary including added tokens."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids with the tokenizer's own special-token post-processing (BOS for Llama)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, token_ids: list[int]) -> str:
        """Text with special tokens skipped."""
        return self._tok.decode(token_ids, skip_special_tokens=True)


def load_tokenizer(checkpoint_dir: str | Path | None, vocab_size: int) -> ByteTokenizer | HFTokenizer:
    """``<checkpoint_dir>/tokenizer.json`` when it exists, else the byte tokenizer.

    Raises ``ValueError`` when the byte tokenizer is needed but the model's
    vocabulary (``vocab_size``) cannot hold its 258 ids.
    """
    if checkpoint_dir is not None:
        path = Path(checkpoint_dir) / "tokenizer.json"
        if path.is_file():
            return HFTokenizer(path)
    if vocab_size < ByteTokenizer.VOCAB_SIZE:
        where = f"checkpoint {str(checkpoint_dir)!r} has no tokenizer.json and " if checkpoint_dir else ""
        raise ValueError(f"{where}the byte tokenizer needs a vocabulary of at least "
                         f"{ByteTokenizer.VOCAB_SIZE}, the model has {vocab_size}")
    return ByteTokenizer()
