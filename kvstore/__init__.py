"""kvstore: a tiered KV-cache offload service for LLM inference.

The public core: :class:`KVLayout` (what a block is), :func:`block_keys` (what
a block is called), :class:`RadixIndex` (which prefixes are cached where) and
:class:`GPUBlockPool` (paged KV memory). Heavier parts (tiers, the tiered
store, the daemon) live in their own modules.
"""

from kvstore.errors import KVStoreError, OutOfBlocks
from kvstore.gpu_pool import GPUBlockPool
from kvstore.hashing import block_keys, root_key
from kvstore.layout import KVLayout
from kvstore.radix import BlockEntry, RadixIndex, RadixMatch

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
