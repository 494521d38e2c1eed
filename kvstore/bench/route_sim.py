"""Simulated replicas for ``kvstore bench route``: real kvstore caches, modelled prefill and decode time.

Each replica is a :class:`~kvstore.bench.cache_sim.TieredCacheSim` (kvstore's radix index with LRU
leaf eviction on a GPU of ``gpu_blocks``, and a host tier below) whose index and tiers record the
store's events (:class:`kvstore.events.EventQueue`: ``stored`` / ``evicted`` per tier), so a router
following them sees exactly what a real replica would publish. Time is modelled:

- prefill is one FIFO server per replica: a request waits for the ones before it, then costs
  ``overhead_s + uncached tokens / prefill_tokens_per_s + host-hit tokens / host_load_tokens_per_s``;
  its cache lookup happens when its prefill starts (that is when the engine looks);
- TTFT = queueing + prefill; decode then takes ``output tokens * decode_s_per_token`` alongside
  other requests (continuous batching; it does not hold the prefill server).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvstore.bench.cache_sim import SimTier, TieredCacheSim
from kvstore.bench.workloads import Request
from kvstore.events import EventQueue, StoreEvent
from kvstore.store.radix import InsertResult, RadixIndex, RadixNode


@dataclass(frozen=True)
class ReplicaModel:
    """The time model of a simulated replica (every replica alike)."""

    gpu_blocks: int
    """GPU KV capacity in trace blocks."""
    host_blocks: int
    """Host-tier capacity in trace blocks (0: none)."""
    block_tokens: int
    prefill_tokens_per_s: float = 15_000.0
    """Prefill throughput of one replica for uncached tokens."""
    host_load_tokens_per_s: float = 300_000.0
    """Tokens per second loaded from the host tier instead of computed (KV bytes / PCIe bandwidth)."""
    overhead_s: float = 0.02
    """Fixed cost of a prefill (scheduling, the partial last block, the first decode step)."""
    decode_s_per_token: float = 0.02
    """Time per output token once the first is out."""

    def prefill_s(self, uncached_tokens: int, host_tokens: int) -> float:
        """Modelled prefill time of one request."""
        return (self.overhead_s + uncached_tokens / self.prefill_tokens_per_s
                + host_tokens / self.host_load_tokens_per_s)


class _EventedIndex(RadixIndex):
    """kvstore's radix index that records ``stored`` / ``evicted`` GPU events, as the store does."""

    def __init__(self, layout: object, events: EventQueue) -> None:
        super().__init__(layout)  # type: ignore[arg-type]
        self.events = events

    def insert(self, keys: Sequence[bytes], *args: object, **kwargs: object) -> InsertResult:
        res = super().insert(keys, *args, **kwargs)  # type: ignore[arg-type]
        for e in res.entries[res.num_existing:]:
            self.events.put("stored", e.key, "gpu")
        return res

    def remove_leaf(self, node: RadixNode) -> None:
        keys = [e.key for e in node.entries]
        super().remove_leaf(node)
        for k in keys:
            self.events.put("evicted", k, "gpu")


class _EventedTier(SimTier):
    """A simulated lower tier that records ``stored`` / ``evicted`` events under its tier name."""

    def __init__(self, capacity: int, name: str, events: EventQueue) -> None:
        super().__init__(capacity, "lru")
        self.name = name
        self.events = events

    def add(self, block: bytes, pinned: Collection[bytes] = ()) -> list[bytes]:
        evicted = super().add(block, pinned)
        if evicted != [block]:
            self.events.put("stored", block, self.name)
            for v in evicted:
                self.events.put("evicted", v, self.name)
        return evicted


class SimReplica:
    """One replica: its cache (with events), its prefill queue, and its counters."""

    def __init__(self, name: str, model: ReplicaModel) -> None:
        self.name = name
        self.model = model
        self.events = EventQueue(maxlen=10_000_000)
        self.cache = TieredCacheSim(model.gpu_blocks, model.host_blocks)
        self.cache.index = _EventedIndex(self.cache.index.layout, self.events)
        self.cache.host = _EventedTier(model.host_blocks, "host", self.events)
        self.cache.disk = _EventedTier(0, "disk", self.events)
        self.queue: deque[int] = deque()
        """Request numbers waiting for the prefill server, oldest first."""
        self.busy_until = 0.0
        self.requests = 0

    def drain_events(self) -> list[StoreEvent]:
        """The cache's events since the last call (what a real replica publishes)."""
        return self.events.drain()

    def start(self, req: Request) -> tuple[int, int, float]:
        """Look the request up and cache it (its prefill starts now); returns (gpu hit blocks, host hit
        blocks, prefill seconds)."""
        hit = self.cache.request(req)
        bt = self.model.block_tokens
        cached = (hit.gpu + hit.host + hit.disk) * bt
        uncached = max(req.prompt_tokens - cached, 0)
        return hit.gpu, hit.host + hit.disk, self.model.prefill_s(uncached, (hit.host + hit.disk) * bt)
