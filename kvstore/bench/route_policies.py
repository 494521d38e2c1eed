"""The routers ``kvstore bench route`` compares, each choosing a replica for one request at a time.

- :class:`RoundRobin`: the baseline.
- :class:`ApproxTree`: SGLang's cache-aware router (the model gateway's ``cache_aware`` policy): one
  approximate radix tree per replica of the prompts the router sent there (it never learns of
  evictions, except by its own size cap); when the load (in-flight requests) is imbalanced --
  ``max - min > balance_abs`` and ``max > balance_rel * min`` -- the least loaded replica; otherwise
  the replica with the longest match if it covers more than ``cache_threshold`` of the prompt, else
  the replica with the smallest tree.
- :class:`KVStoreRouter`: kvstore's: the replicas' own KV events (through msgpack, as on the wire)
  into a :class:`~kvstore.route.index.RouterIndex`, and :class:`~kvstore.route.policy.CostPolicy`
  over the router's accounting of in-flight work.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence

from kvstore.bench.cache_sim import TieredCacheSim
from kvstore.bench.workloads import Request
from kvstore.events import StoreEvent
from kvstore.route.index import RouterIndex
from kvstore.route.kv_events import decode_batch, encode_batch
from kvstore.route.policy import CostPolicy, ReplicaLoad
from kvstore.route.translate import batch_of, kv_events

SGLANG_CACHE_THRESHOLD = 0.3
SGLANG_BALANCE_ABS = 64
SGLANG_BALANCE_REL = 1.5
"""The SGLang model gateway's defaults for its cache-aware policy."""
SGLANG_MAX_TREE_TOKENS = 2**26 // 4
"""Its tree cap is 2**26 characters; at about 4 characters per token, this many tokens."""


def keys_of(req: Request) -> list[bytes]:
    """The request's block keys as the simulated replicas index them (the trace's chain ids)."""
    return [i.to_bytes(8, "little") for i in req.blocks.tolist()]


class RoundRobin:
    """Each replica in turn."""

    def __init__(self, names: Sequence[str]) -> None:
        self._next = itertools.cycle(names)

    def choose(self, req: Request, keys: list[bytes], loads: Mapping[str, ReplicaLoad]) -> tuple[str, int]:
        """The replica and the blocks the router expects cached there (none: it does not know)."""
        return next(self._next), 0

    def ingest(self, replica: str, events: list[StoreEvent]) -> None:
        """Round robin follows no events."""


class ApproxTree:
    """SGLang-style approximate-tree routing (see the module docstring)."""

    def __init__(self, names: Sequence[str], block_tokens: int, cache_threshold: float = SGLANG_CACHE_THRESHOLD,
                 balance_abs: int = SGLANG_BALANCE_ABS, balance_rel: float = SGLANG_BALANCE_REL) -> None:
        cap = max(SGLANG_MAX_TREE_TOKENS // block_tokens, 1)
        self.trees = {n: TieredCacheSim(cap) for n in names}
        self.names = list(names)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def choose(self, req: Request, keys: list[bytes], loads: Mapping[str, ReplicaLoad]) -> tuple[str, int]:
        """The replica SGLang's policy picks, and the blocks its tree thinks are cached there."""
        n = {r: loads[r].in_flight_requests for r in self.names}
        lo, hi = min(n.values()), max(n.values())
        matched = {r: self._matched(self.trees[r], keys) for r in self.names}
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            pick = min(self.names, key=lambda r: (n[r], r))
        else:
            best = max(self.names, key=lambda r: (matched[r], -n[r]))
            rate = matched[best] / len(keys) if keys else 0.0
            pick = best if rate > self.cache_threshold else min(self.names, key=lambda r: (len(self.trees[r].index), r))
        self.trees[pick].request(req)
        return pick, matched[pick]

    @staticmethod
    def _matched(tree: TieredCacheSim, keys: list[bytes]) -> int:
        """Blocks of ``keys`` the tree holds from the start (no access-time change: only the chosen tree is touched)."""
        get = tree.index.get
        n = 0
        for k in keys:
            if get(k) is None:
                break
            n += 1
        return n

    def ingest(self, replica: str, events: list[StoreEvent]) -> None:
        """The approximate tree follows no events."""


class KVStoreRouter:
    """kvstore's router over the replicas' KV events; ``ingest`` goes through msgpack as the subscriber does."""

    def __init__(self, names: Sequence[str], policy: CostPolicy, block_tokens: int) -> None:
        self.index = RouterIndex()
        for n in names:
            self.index.add_replica(n)
        self.policy = policy
        self.block_tokens = block_tokens
        self.events = 0
        self.ingest_s = 0.0

    def choose(self, req: Request, keys: list[bytes], loads: Mapping[str, ReplicaLoad]) -> tuple[str, int]:
        """The cheapest replica by the policy, and its cached prefix in blocks."""
        d = self.policy.choose(len(keys), self.index.cached_prefix(keys), loads,
                               held={n: self.index.blocks(n) for n in loads})
        return d.replica, d.hit.blocks

    def ingest(self, replica: str, events: list[StoreEvent]) -> None:
        """Encode the events as the replica publishes them, decode and apply them as the router does."""
        payload = encode_batch(batch_of(kv_events(events, self.block_tokens)))
        t0 = time.perf_counter()
        self.index.apply(replica, decode_batch(payload))
        self.ingest_s += time.perf_counter() - t0  # the router's share: decode + apply
        self.events += len(events)
