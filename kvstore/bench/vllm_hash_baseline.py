"""The baseline for the ``lookup`` suite: prefix lookup hashed the way vLLM hashes blocks.

vLLM's prefix caching (``hash_block_tokens`` with ``sha256`` as the hash
function) keys a full block by ``SHA-256(pickle.dumps((parent_hash,
tuple(block_token_ids), extra_keys), protocol=HIGHEST))`` and finds the cached
prefix by looking each block hash up in a dict until the first miss.
Written here from that description so the benchmark needs no vLLM install.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

NONE_HASH = hashlib.sha256(b"vllm-baseline-root").digest()
"""Parent hash of the first block (vLLM seeds it once per process; fixed here)."""


def vllm_block_hashes(tokens: Sequence[int], block_size: int, extra_keys: Any = None) -> list[bytes]:
    """SHA-256 chain over pickled ``(parent, tokens, extra_keys)`` for each full block."""
    parent = NONE_HASH
    out: list[bytes] = []
    dumps, sha = pickle.dumps, hashlib.sha256
    proto = pickle.HIGHEST_PROTOCOL
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start : start + block_size])
        parent = sha(dumps((parent, block, extra_keys), protocol=proto)).digest()
        out.append(parent)
    return out


class VLLMPrefixCache:
    """Hash-to-block dict, as vLLM's ``cached_block_hash_to_block``."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[bytes, int] = {}

    def insert(self, tokens: Sequence[int]) -> None:
        """Cache every full block of ``tokens``."""
        for h in vllm_block_hashes(tokens, self.block_size):
            self.blocks.setdefault(h, len(self.blocks))

    def match(self, tokens: Sequence[int]) -> int:
        """Number of leading full blocks of ``tokens`` that are cached (hash the prompt, then probe)."""
        n = 0
        for h in vllm_block_hashes(tokens, self.block_size):
            if h not in self.blocks:
                break
            n += 1
        return n
