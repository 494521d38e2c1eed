"""Helpers for tiered-store tests: a dict-backed lower tier with an optional delay, and block data."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvstore.config.schema import PolicyConfig
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout
from kvstore.store.tiered import TieredStore
from kvstore.tiers.base import Buffer, Tier
from kvstore.tiers.host.tier import HostTier

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16", model_id="store-test")


class MemoryTier(Tier):
    """A capped LRU dict tier standing in for a disk; ``delay_s`` slows every get (for stop policies)."""

    name = "disk"

    def __init__(self, layout: KVLayout, capacity_blocks: int = 1000, delay_s: float = 0.0) -> None:
        super().__init__(layout)
        self.capacity_blocks = capacity_blocks
        self.delay_s = delay_s
        self.data: OrderedDict[bytes, bytes] = OrderedDict()
        self.gets = 0
        self._lock = threading.Lock()

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self._lock:
            while n < len(keys) and keys[n] in self.data:
                n += 1
        return n

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self.data

    def get(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        if self.delay_s:
            time.sleep(self.delay_s * len(keys))
        out = []
        with self._lock:
            self.gets += len(keys)
            for k, d in zip(keys, dests):
                v = self.data.get(k)
                if v is None:
                    self._stats.misses += 1
                    out.append(False)
                    continue
                self.data.move_to_end(k)
                d.copy_(torch.frombuffer(bytearray(v), dtype=torch.uint8))
                self._stats.hits += 1
                out.append(True)
        return out

    def put(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        with self._lock:
            for k, s in zip(keys, srcs):
                if k in self.data:
                    continue
                while len(self.data) >= self.capacity_blocks:
                    old, _ = self.data.popitem(last=False)
                    self._stats.evictions += 1
                    self._emit("evicted", old)
                self.data[k] = s.cpu().numpy().tobytes()
                self._stats.puts += 1
            self._stats.num_blocks = len(self.data)
        return [True] * len(keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return sum(1 for k in keys if self.data.pop(k, None) is not None)


def make_store(
    gpu_blocks: int = 8,
    host_blocks: int | None = 8,
    disk: Tier | None = None,
    **policy: object,
) -> TieredStore:
    """A CPU store over :data:`LAYOUT`; ``host_blocks=None`` disables the host tier."""
    pool = GPUBlockPool(LAYOUT, gpu_blocks, device="cpu")
    host = HostTier(LAYOUT, host_blocks * LAYOUT.bytes_per_block, auto_evict=False) if host_blocks else None
    return TieredStore(LAYOUT, pool, host, disk, PolicyConfig(**policy))


def fill(store: TieredStore, block_ids: Sequence[int], seed: int) -> list[torch.Tensor]:
    """Write distinct random KV into GPU blocks; returns copies of what was written."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in block_ids:
        data = torch.randn(LAYOUT.block_shape, generator=g).to(LAYOUT.torch_dtype)
        store.pool.block(b).copy_(data)
        out.append(data.clone())
    return out


def fill_keyed(store: TieredStore, block_ids: Sequence[int], keys: Sequence[bytes]) -> list[torch.Tensor]:
    """Write KV derived from each block's key (as real KV is a function of its tokens): two writes of one key
    always carry the same bytes, so any mismatch a reader sees is corruption, never a test artifact."""
    out = []
    for b, key in zip(block_ids, keys):
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
        data = torch.randn(LAYOUT.block_shape, generator=g).to(LAYOUT.torch_dtype)
        store.pool.block(b).copy_(data)
        out.append(data.clone())
    return out


def prefill(store: TieredStore, tokens: list[int], seed: int = 0, salt: str | None = None) -> list[torch.Tensor]:
    """What an engine does for a fresh prompt: allocate, write KV, commit full blocks, free its references."""
    keys = store.keys(tokens, salt)
    blocks = store.allocate(len(keys))
    data = fill(store, blocks, seed)
    store.commit(keys, blocks, tokens, salt)
    store.free(blocks)
    return data


def read_lease(store: TieredStore, tokens: list[int], salt: str | None = None) -> tuple[list[torch.Tensor], object]:
    """Look up, acquire, wait and copy out the prefix blocks; returns (data, lease) after release."""
    m = store.lookup(tokens, salt)
    lease = store.acquire(m)
    lease.resolve()
    lease.wait()
    data = [store.pool.block(b).clone() for b in lease.block_ids]
    store.release(lease)
    return data, lease
