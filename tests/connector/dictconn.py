"""``DictConnector``: a minimal KV store written against ``connectors.base`` alone.

A GPU-only prefix cache in a dict (block key -> GPU block, the cache holding
one pool reference per block). It exists to show that another store can
implement :class:`KVConnector` with the API's own types, the layout, the
block hashing and the GPU pool, and nothing of kvstore's store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from connectors.base import KVConnector, Lease, PrefixMatch
from kvstore.errors import OutOfBlocks
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.hashing import Salt, block_keys
from kvstore.layout import KVLayout


class DictLease(Lease):
    """GPU hits only: every block is ready at acquire, so resolving and waiting do nothing."""

    def __init__(self, block_ids: list[int], block_size: int) -> None:
        self._ids = block_ids
        self._bs = block_size
        self.released = False

    @property
    def block_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def shortfall(self) -> str | None:
        return None

    @property
    def load_wait_s(self) -> float:
        return 0.0

    def resolve(self) -> int:
        return len(self._ids) * self._bs

    def wait_layer(self, layer: int) -> None:
        pass  # GPU-only store: every leased block is resident before acquire returns

    def wait(self) -> None:
        pass

    def tokens_by_tier(self) -> dict[str, int]:
        return {"gpu": len(self._ids) * self._bs, "host": 0, "disk": 0}


class DictConnector(KVConnector):
    """The dict-backed connector; ``cached`` maps each committed key to its GPU block."""

    def __init__(self) -> None:
        self._pool: GPUBlockPool | None = None
        self.cached: dict[bytes, int] = {}

    @property
    def pool(self) -> GPUBlockPool:
        if self._pool is None:
            raise RuntimeError("DictConnector used before register(pool)")
        return self._pool

    def register(self, pool: GPUBlockPool) -> None:
        self._pool = pool

    @property
    def layout(self) -> KVLayout:
        return self.pool.layout

    def keys(self, tokens: Sequence[int], salt: Salt = None, parent: bytes | None = None) -> list[bytes]:
        return block_keys(tokens, self.layout, salt, parent=parent)

    def lookup(self, tokens: Sequence[int], salt: Salt = None) -> PrefixMatch:
        hit: list[bytes] = []
        for k in self.keys(tokens, salt):
            if k not in self.cached:
                break
            hit.append(k)
        return PrefixMatch(tuple(hit), ("gpu",) * len(hit), self.layout.block_size, len(tokens), handle=self)

    def acquire(self, match: PrefixMatch, window: int = 0) -> Lease:
        if match.handle is not self:
            raise ValueError("acquire: the match was made by another connector")
        ids = [self.cached[k] for k in match.keys]
        self.pool.incref(ids)
        return DictLease(ids, self.layout.block_size)

    def release(self, lease: Lease) -> None:
        if not isinstance(lease, DictLease):
            raise TypeError(f"release: not a DictLease: {type(lease).__name__}")
        if not lease.released:
            lease.released = True
            self.pool.free(lease.block_ids)

    def allocate(self, n: int) -> list[int]:
        if self.pool.num_free < n:
            self.offload("gpu")
        ids = self.pool.try_allocate(n)
        if ids is None:
            raise OutOfBlocks(n, self.pool.num_free)
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        self.pool.free(block_ids)

    def commit_keys(self, keys: Sequence[bytes], block_ids: Sequence[int], tokens: Sequence[int] | None = None,
                    salt: Salt = None) -> int:
        if len(keys) != len(block_ids):
            raise ValueError(f"commit: {len(keys)} keys but {len(block_ids)} blocks")
        new = 0
        for k, b in zip(keys, block_ids):
            if k not in self.cached:
                self.pool.incref([b])
                self.cached[k] = b
                new += 1
        return new

    def save(self, keys: Sequence[bytes]) -> int:
        return 0  # no host tier

    def offload(self, tier: str) -> int:
        """``"gpu"`` drops every cached block only the cache holds (there is no tier below)."""
        if tier == "host":
            return 0
        if tier != "gpu":
            raise ValueError(f"offload: tier must be 'gpu' or 'host', got {tier!r}")
        unheld = [k for k, b in self.cached.items() if self.pool.ref_count(b) == 1]
        for k in unheld:
            self.pool.free([self.cached.pop(k)])
        return len(unheld)

    def flush(self) -> None:
        pass  # nothing durable to flush: this store has no lower tier

    def stats(self) -> dict[str, Any]:
        return {"cached_blocks": len(self.cached)}

    def close(self) -> None:
        self.pool.free(list(self.cached.values()))
        self.cached.clear()
