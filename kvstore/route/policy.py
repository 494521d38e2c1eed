"""Choose a replica: the fewest uncached prompt blocks, weighed against how busy each replica is.

``cost(r) = block_weight * sum over the prompt's blocks of miss(r, block) + request_weight *
in_flight_requests(r) + token_weight * in_flight_tokens(r)``, where ``miss`` is 1 for a block
replica ``r`` must compute and the tier's weight (below 1) for one it must load. The prefix term
alone sends all traffic to whichever replica cached most, so the load term is what keeps the
fleet balanced; with ``token_weight = block_weight / block_tokens`` both terms are in units of
"tokens of prefill waiting", an estimate of the time to first token.

Replicas with other block sizes (a vLLM replica keyed in its own blocks beside kvstore's) are
made comparable by a per-replica ``scale``: its block size in the policy's block unit (the
fleet's kvstore block size). The prompt's length is then counted in unit blocks for everyone,
and a replica's hit and loaded blocks are multiplied by its scale; a scale of 1 (every kvstore
replica) gives exactly the unscaled cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvstore.route.index import PrefixHit

DEFAULT_TIER_WEIGHTS: dict[str, float] = {"gpu": 0.0, "host": 0.05, "disk": 0.2, "remote": 0.3}
"""Cost of a cached block relative to computing it (1): loading from RAM is cheap, from the network dearer."""

DEFAULT_LOAD_WEIGHT = 0.05
"""A prompt token queued on a replica costs this fraction of an uncached prompt token. Weight 1 is the plain
time-to-first-token estimate, which gives up hit rate (and so future TTFT) for little; on the Mooncake
trace (``kvstore bench route``) 0.05 kept the most hits while TTFT stayed at its best (docs/BENCHMARKS.md)."""


class NoReplicaError(RuntimeError):
    """No replica is up to take the request."""


@dataclass
class ReplicaLoad:
    """What the router knows of a replica's load (its own accounting, refreshed from the replica's metrics)."""

    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    """Prompt tokens still to prefill plus tokens still to decode, as the router accounts them."""
    up: bool = True


@dataclass(frozen=True)
class Decision:
    """The chosen replica, the prefix it holds, and every candidate's cost (for metrics and tests)."""

    replica: str
    hit: PrefixHit
    costs: dict[str, float]


@dataclass
class CostPolicy:
    """Cheapest replica by :func:`cost`; ties: fewest in-flight requests, then fewest blocks held, then name.
    Holds no state."""

    block_weight: float = 1.0
    """Cost of one prompt block the replica must compute."""
    request_weight: float = 0.0
    """Cost of one request in flight on the replica."""
    token_weight: float = DEFAULT_LOAD_WEIGHT / 16
    """Cost of one token in flight on the replica; :meth:`for_block_size` sets it from the load weight and the
    block size (the default assumes kvstore's default 16-token blocks)."""
    tier_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    """Fraction of ``block_weight`` a block cached in each tier still costs."""

    @classmethod
    def for_block_size(cls, block_tokens: int, load_weight: float = DEFAULT_LOAD_WEIGHT,
                       tier_weights: dict[str, float] | None = None) -> CostPolicy:
        """A policy whose two terms are in prompt tokens: a block to compute costs ``block_tokens``-worth,
        a queued token ``load_weight`` of an uncached one."""
        if block_tokens <= 0 or load_weight < 0:
            raise ValueError(f"block_tokens must be > 0 and load_weight >= 0, got {block_tokens}, {load_weight}")
        return cls(block_weight=1.0, token_weight=load_weight / block_tokens,
                   tier_weights=dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights))

    def cost(self, num_blocks: int, hit: PrefixHit, load: ReplicaLoad, scale: float = 1.0) -> float:
        """The cost of sending a prompt of ``num_blocks`` full blocks to a replica with ``hit`` and ``load``;
        ``scale``: the replica's block size in units of the blocks ``num_blocks`` counts (its hit is in its own
        blocks)."""
        loaded = sum(self.tier_weights.get(t, 1.0) * n for t, n in hit.by_tier.items())
        missing = max(num_blocks - hit.blocks * scale, 0)
        return (self.block_weight * (missing + loaded * scale) + self.request_weight * load.in_flight_requests
                + self.token_weight * load.in_flight_tokens)

    def choose(self, num_blocks: int, hits: Mapping[str, PrefixHit], loads: Mapping[str, ReplicaLoad],
               scales: Mapping[str, float] | None = None, held: Mapping[str, int] | None = None) -> Decision:
        """The cheapest replica that is up among ``loads`` (a replica without a hit has none cached; one without
        a scale has scale 1: see :meth:`cost`). ``held``: blocks each replica's events say it holds; among
        replicas of equal cost and load, a new prefix goes where the cache is emptiest, so conversations that
        arrive one at a time spread over the replicas instead of all landing on the first name.

        Raises :class:`NoReplicaError` when none is up. Changes nothing.
        """
        costs: dict[str, float] = {}
        empty = PrefixHit(0, {})
        for name, load in loads.items():
            if load.up:
                scale = 1.0 if scales is None else scales.get(name, 1.0)
                costs[name] = self.cost(num_blocks, hits.get(name, empty), load, scale)
        if not costs:
            raise NoReplicaError(f"no replica is up (known: {', '.join(sorted(loads)) or 'none'})")
        best = min(costs, key=lambda r: (costs[r], loads[r].in_flight_requests, (held or {}).get(r, 0), r))
        return Decision(best, hits.get(best, empty), costs)
