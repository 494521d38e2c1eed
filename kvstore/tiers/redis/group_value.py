"""One remote value holds a group of consecutive blocks: their encoded forms back to back.

::

    value = encode(block[g*G], key[g*G]) ‖ encode(block[g*G+1], key[g*G+1]) ‖ … ‖ encode(block[g*G+G-1], key[g*G+G-1])

stored under ``key[g*G+G-1]``, the chained key of the group's last block (which depends on every
token before it, so the group's key names the whole prefix up to its end). Each block keeps the disk
tier's header and key-bound checksum (:mod:`kvstore.tiers.codec`); a value that is short, has trailing
bytes, holds the wrong number of blocks or fails any block's check is corrupt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvstore.tiers.codec import decode_into, encode, encoded_length
from kvstore.errors import CorruptBlock
from kvstore.tiers.base import Buffer


def encode_group(keys: Sequence[bytes], srcs: Sequence[Buffer], codec: str, level: int, fingerprint: bytes,
                 itemsize: int) -> bytes:
    """The value of one group (``keys`` are the group's block keys in chain order). Changes nothing."""
    return b"".join(encode(src, codec, level, fingerprint, itemsize, key=key) for key, src in zip(keys, srcs))


def decode_group(value: bytes, keys: Sequence[bytes], dests: Mapping[int, Buffer], fingerprint: bytes) -> None:
    """Verify ``value`` as the group of ``keys`` and decode block ``i`` into ``dests[i]`` for each given ``i``.

    Every block's length is checked (so a short or padded value fails whatever ``dests`` asks for);
    the blocks asked for are fully verified. Raises :class:`CorruptBlock` naming the group's key.
    """
    offsets: list[int] = []
    off = 0
    group_key = keys[-1]
    for key in keys:
        offsets.append(off)
        off += encoded_length(value, off, group_key)
    if off != len(value):
        raise CorruptBlock(group_key, "length mismatch", f"{len(value) - off} trailing bytes after {len(keys)} blocks")
    mv = memoryview(value)
    for i, dest in dests.items():
        end = offsets[i + 1] if i + 1 < len(keys) else len(value)
        decode_into(mv[offsets[i]:end], dest, fingerprint, keys[i])
