"""kvstore: a tiered KV-cache offload service for LLM inference.

The public core: :class:`KVLayout` (what a block is), :func:`block_keys` (what
a block is called), :class:`RadixIndex` (which prefixes are cached where) and
:class:`GPUBlockPool` (paged KV memory). Heavier parts (tiers, the tiered
store, the daemon) live in their own modules.

:class:`GPUBlockPool` is loaded on first use: it needs torch, and importing
torch takes seconds, which commands such as ``kvstore --help`` must not pay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.errors import KVStoreError, OutOfBlocks
from kvstore.hashing import block_keys, root_key
from kvstore.layout import KVLayout
from kvstore.store.radix import BlockEntry, RadixIndex, RadixMatch

__all__ = [
    "BlockEntry",
    "GPUBlockPool",
    "KVLayout",
    "KVStoreError",
    "OutOfBlocks",
    "RadixIndex",
    "RadixMatch",
    "block_keys",
    "root_key",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvstore.store.gpu_pool import GPUBlockPool


def __getattr__(name: str) -> Any:
    """Import :class:`GPUBlockPool` (and with it torch) only when it is asked for."""
    if name == "GPUBlockPool":
        from kvstore.store.gpu_pool import GPUBlockPool

        return GPUBlockPool
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
