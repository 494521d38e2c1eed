"""Tensor-parallel shards: each rank of a TP group stores and loads its own slice of every block.

Under tensor parallelism a vLLM worker holds only its rank's KV heads, so one kvstore block of a rank is
that rank's pages of every layer (the layout is the shard's, the same for every rank), and the ranks'
blocks of one prompt block must never be confused. A rank's key is the prompt block's key made the
rank's own::

    shard key = BLAKE2b-256(key, key="kvstore-tp|<rank>/<size>")      (size 1: the key itself)

so the keys of TP=1 engines are unchanged, and one daemon serves every rank (one layout, disjoint keys).
The scheduler sees no rank: it counts a block as cached only when every rank's shard is there (the least
of the ranks' prefixes), so a rank that lost a shard makes vLLM compute that block on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """One rank of a tensor-parallel group of ``size`` ranks."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in 0..{self.size - 1}")

    def keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """This rank's keys for the prompt blocks ``keys`` (the keys themselves when there is one rank)."""
        if self.size == 1:
            return list(keys)
        secret = f"kvstore-tp|{self.rank}/{self.size}".encode()
        return [hashlib.blake2b(k, digest_size=32, key=secret).digest() for k in keys]


def all_shards(size: int) -> list[Shard]:
    """Every rank of a group of ``size``."""
    return [Shard(r, size) for r in range(size)]
