"""The identity of a checkpoint's weights, for the layout fingerprint mixed into every block key.

KV depends on the weights, so two checkpoints must never share cached blocks,
and the same checkpoint must get the same identity wherever it is mounted. A
path is wrong on both counts (a fine-tune swapped in place keeps its path; a
copy elsewhere changes it). The identity here is a BLAKE2b digest of
``config.json`` and, per ``*.safetensors`` file, its size, its header (tensor
names, shapes, dtypes, offsets) and 64 KiB samples at 64 evenly spaced
offsets of the tensor data. Sampling keeps it fast for 100 GB checkpoints
(about 4 MiB read per file) while any fine-tune that changes most tensors
changes the digest; pass an explicit ``model_id`` to ``LLM`` for full control.

A single-file checkpoint (GGUF) is hashed the same way: its size, its first
64 KiB (header and most metadata) and 64 samples spread over the whole file.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import BinaryIO

SAMPLES = 64
SAMPLE_BYTES = 64 * 1024


def checkpoint_identity(directory: str | Path) -> str:
    """``"<name>@<16 hex digits>"`` for a Hugging Face checkpoint directory or a single-file checkpoint.

    The digest is :func:`weights_digest`; the name (the file's or directory's) only makes it readable.
    """
    root = Path(directory)
    return f"{(root.name if root.is_file() else root.resolve().name)}@{weights_digest(root)}"


def weights_digest(directory: str | Path) -> str:
    """16 hex digits naming the weights of a checkpoint directory or single-file checkpoint, wherever it lies.

    Unlike :func:`checkpoint_identity` it carries no name, so a copy of the
    same checkpoint under another directory name gets the same value.
    """
    root = Path(directory)
    h = hashlib.blake2b(digest_size=8, person=b"kvstore.model")
    if root.is_file():
        size = root.stat().st_size
        h.update(size.to_bytes(8, "little"))
        with root.open("rb") as f:
            h.update(f.read(SAMPLE_BYTES))
            _hash_samples(f, h, 0, size)
        return h.hexdigest()
    config = root / "config.json"
    h.update(config.read_bytes() if config.exists() else b"")
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(path.name.encode() + size.to_bytes(8, "little"))
        with path.open("rb") as f:
            head = f.read(8)
            header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            h.update(f.read(min(header_len, size)))
            start = 8 + header_len
            _hash_samples(f, h, start, max(size - start, 0))
    return h.hexdigest()


def _hash_samples(f: BinaryIO, h: hashlib.blake2b, start: int, span: int) -> None:
    """Feed ``SAMPLES`` reads of ``SAMPLE_BYTES`` evenly spaced over ``[start, start + span)`` into ``h``."""
    for i in range(SAMPLES if span else 0):
        f.seek(start + span * i // SAMPLES)
        h.update(f.read(SAMPLE_BYTES))
