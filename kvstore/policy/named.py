"""Placement policies by name: one field, ``policy.placement``, decides how every tier below the GPU orders
its blocks, whether a block's use count follows it between tiers, whether the tiers hold copies of each
other's blocks or each block lives in one, and how long counts of blocks that left are remembered.

These were eight separate settings (an ``eviction`` per tier, ``carry_uses``, ``exclusive_tiers``,
``use_memory``, ``duel_scope``, ``gdsf_weight``) with 408 valid combinations, many identical; the best of
them was found only by tuning on the trace it was judged on. A named policy is a combination that was
measured as a whole (``kvstore bench hitrate``, docs/BENCHMARKS.md "hitrate"), as vLLM's offloading names
its ``CachePolicy`` (``lru``, ``arc``), SGLang its ``radix_eviction_policy`` and LMCache its
``cache_policy``. The research variants the bench also replays are parameters of
:class:`~kvstore.bench.cache_sim.TieredCacheSim`, not config fields.

Each policy builds fresh eviction orders for the host and the disk tier (:meth:`PlacementPolicy.orders`);
the tiers store, the orders decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvstore.policy.duel import shared_duel
from kvstore.policy.gdsf import DAMPED, LINEAR, CountWeight
from kvstore.policy.order import EvictionOrder, make_order

OrderName = Literal["lru", "s3fifo", "gdsf", "duel"]


@dataclass(frozen=True)
class TierOrders:
    """Fresh, empty eviction orders for the host tier and the disk tier (lmdb, file or slab) of one store."""

    host: EvictionOrder
    disk: EvictionOrder


@dataclass(frozen=True)
class PlacementPolicy:
    """How blocks are placed below the GPU (the GPU itself evicts whole radix leaves, least recently used)."""

    name: str
    order: OrderName
    """The eviction order of the host and the disk tier (:func:`~kvstore.policy.order.make_order`)."""
    carry_uses: bool = False
    """A block's use count (its insert plus the lookups that matched it) follows it into the tier it enters,
    so a frequency-aware order there starts it at its uses so far instead of 1."""
    exclusive_when_write_back: bool = False
    """Under ``policy.write: write_back`` (the default) host and disk hold distinct blocks and host none the GPU
    holds (the lower tiers add capacity instead of holding copies of each other's blocks); a disk copy stays
    while the GPU holds the block, as it may have been acknowledged as durable. Other write policies copy
    blocks down before they leave the GPU, so the tiers are inclusive there."""
    use_memory: float = 0.0
    """Remember the counts of blocks that left every tier, for this multiple of the host + disk capacity in
    blocks, so a block that comes back resumes its count (0: off)."""
    shared_duel: bool = False
    """With ``order: duel`` and both a host and a disk tier: one referee chooses the victims of both, scored
    as one cache (:func:`~kvstore.policy.duel.shared_duel`); otherwise each tier duels on its own."""
    weight: CountWeight = LINEAR
    """How a use count enters a GDSF priority (:data:`~kvstore.policy.gdsf.LINEAR`, :data:`~kvstore.policy.gdsf.DAMPED`)."""
    summary: str = ""
    """One line for ``--help``, the config reference and logs."""

    def orders(self, both_tiers: bool = True) -> TierOrders:
        """New orders for the host and the disk tier; ``both_tiers``: the store has both (a shared duel then
        spans them, else each tier's duel scores itself)."""
        if self.order == "duel" and self.shared_duel and both_tiers:
            host, disk = shared_duel(2, self.weight)
            return TierOrders(host, disk)
        return TierOrders(make_order(self.order, self.weight), make_order(self.order, self.weight))

    def exclusive(self, write: str) -> bool:
        """Whether the tiers are exclusive under the write policy ``write`` (``policy.write``)."""
        return self.exclusive_when_write_back and write == "write_back"


POLICIES: dict[str, PlacementPolicy] = {p.name: p for p in (
    PlacementPolicy("lru", "lru", summary="least recently used first in host and disk; no use counts"),
    PlacementPolicy("s3fifo", "s3fifo", summary="S3-FIFO in host and disk: a small queue filters one-time blocks, "
                    "a ghost of 4 capacities of keys brings returning ones straight to the main queue"),
    PlacementPolicy("gdsf", "gdsf", carry_uses=True, summary="lowest L + use count first (frequency with aging), "
                    "counts carried between tiers"),
    PlacementPolicy("adaptive", "duel", carry_uses=True, exclusive_when_write_back=True, use_memory=4.0,
                    shared_duel=True, weight=DAMPED,
                    summary="GDSF (damped counts) or S3-FIFO, chosen online by which one's miniature on a hash "
                    "sample hits more, one choice for host and disk; counts carried and remembered for 4x the "
                    "capacity; host and disk hold distinct blocks under write_back"),
)}
"""Every named placement policy (``policy.placement``)."""

DEFAULT_PLACEMENT = "adaptive"
"""The policy a config gets unless it names another (chosen in docs/BENCHMARKS.md "hitrate")."""


def placement_policy(name: str) -> PlacementPolicy:
    """The policy called ``name``; ``ValueError`` naming the known ones for another name."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; known: {', '.join(POLICIES)}") from None
