"""The parts of the tiered store that its components share, and the bookkeeping they all need.

:class:`Hierarchy` holds the radix index, the GPU pool, the lower tiers, the
event queue, the counters and the one lock that serialises index changes. It
is passed explicitly to the spiller and the prefetcher (no globals); its
:class:`~kvstore.store.placement.Placement` is the one owner of residency changes.

Reference counts: the index holds one reference on every GPU block it
records; a lease, an engine sequence or a copy in flight holds its own. A
GPU block whose count is 1 is therefore cached but unused, and may be evicted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.events import EventQueue
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout
from kvstore.store.placement import Placement
from kvstore.store.radix import BlockEntry, RadixIndex
from kvstore.tiers.base import Tier
from kvstore.tiers.chain import ChainTier
from kvstore.tiers.host.tier import HostTier
from kvstore.policy.use_memory import UseMemory

LOWER_TIERS = ("host", "disk", "remote")
"""The lower tiers in their fixed order, fastest first; a store has any subset of them."""


@dataclass
class StoreCounters:
    """Store-level counters (tier-level ones live in each tier's ``TierStats``)."""

    lookups: int = 0
    prompt_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "host": 0, "disk": 0, "remote": 0})
    """Tokens of looked-up prompts found in each tier (fastest copy); a tier that fronts others (a daemon) counts
    under their names (its :attr:`~kvstore.tiers.base.Tier.served_as`: ``daemon:host``, ...) instead of its own."""
    loaded_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "remote": 0})
    """Blocks brought up to the GPU from each tier by prefetches."""
    load_failures: int = 0
    """Blocks a prefetch planned but could not load (gone, corrupt, no room)."""
    gpu_evictions: int = 0
    spilled_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "remote": 0})
    """Blocks copied down by eviction or by the write policy."""
    dropped_blocks: int = 0
    """Blocks removed from the index because no tier held them any more."""


class Hierarchy:
    """Shared state of one tiered store. Hold :attr:`lock` while touching the index or the pool.

    :attr:`lock` is a plain (non re-entrant) mutex: no code path takes it
    twice, and nothing under it does disk or socket I/O. :attr:`placement`
    is the only code that changes where a block lives.
    """

    def __init__(
        self,
        layout: KVLayout,
        pool: GPUBlockPool,
        host: HostTier | None,
        disk: Tier | None,
        remote: ChainTier | None = None,
        *,
        carry_uses: bool = False,
        use_memory: UseMemory | None = None,
        exclusive: bool = False,
    ) -> None:
        """``carry_uses``: seed the lower tiers' use counts from the index entries; ``use_memory``: where the
        counts of dropped entries are remembered; ``exclusive``: host and disk hold distinct blocks, and host
        none the GPU holds (all three from the placement policy, ``policy.placement``, :mod:`kvstore.policy.named`)."""
        if pool.layout != layout:
            raise ValueError("the GPU pool's layout differs from the store's")
        self.layout = layout
        self.pool = pool
        self.host = host
        self.disk = disk
        self.remote = remote
        """The shared tier below disk. Never mirrored in the index (other engines write to it and its
        server evicts on its own): lookups probe it beyond the local match, loads read it by chain position."""
        self.carry_uses = carry_uses
        """Whether a block entering host or disk brings its use count (:meth:`Placement.uses_of`) to the tier's order."""
        self.use_memory = use_memory
        """Counts of blocks that left every tier, restored when they are indexed again (``None``: forgotten)."""
        self.exclusive = exclusive
        """Whether a block loaded into the GPU leaves host and a disk load is not copied into host (its disk copy
        stays; GPU victims go to host unless the disk has them, host victims to disk)."""
        self.has_lower_tiers = host is not None or disk is not None or remote is not None
        """Whether any tier lies below the GPU (a lookup hashes the tail past its match only to probe them)."""
        self.disk_reports_evictions = disk is None or disk.reports_evictions
        """Whether the disk tier announces its evictions; when not, a lookup asks it instead of trusting ``on_disk``."""
        self.index = RadixIndex(layout)
        self.events = EventQueue()
        self.counters = StoreCounters()
        for _, tier in self.lower_tiers():
            self.counters.hit_tokens.update(dict.fromkeys(tier.served_as, 0))
        self.lock = threading.Lock()
        self.placement = Placement(self)
        self.placeholders: set[int] = set()
        """GPU blocks that hold a lease's place for a block outside the reader's attention window, its data never
        loaded (:meth:`TieredStore.acquire` with ``window``): never recorded as a copy of any block."""
        self.hand_down: Callable[[BlockEntry], None] | None = None
        """Called under :attr:`lock` just before a block loses its last local copy: a host copy evicted with
        no disk tier and no GPU copy (:meth:`Placement.evict_host`), or a block removed from the index with
        its copies (:meth:`Placement.drop_from`: a GPU victim with nowhere to go, or the blocks after a broken
        prefix). The remote tier's ``write_back`` sets it (:meth:`RemoteWriter.hand_down`); a disk tier's own
        evictions reach the writer through the tier's victim hook instead (:meth:`RemoteWriter.disk_victims`)."""

    def lower_tiers(self) -> list[tuple[str, Tier]]:
        """``[("host", tier), ("disk", tier), ("remote", tier)]`` for the tiers that exist, fastest first."""
        tiers: dict[str, Tier | None] = {"host": self.host, "disk": self.disk, "remote": self.remote}
        return [(name, t) for name in LOWER_TIERS if (t := tiers[name]) is not None]

    def sync_tier_events(self) -> None:
        """Apply what the lower tiers did on their own (capacity evictions, corrupt drops) to the index.

        Takes the lock; call it without holding it.
        """
        with self.lock:
            for name, tier in self.lower_tiers():
                for ev in tier.drain_events():
                    self.events.put("corrupt" if ev.kind == "corrupt" else "evicted", ev.key, name)
                    if name != "remote":  # the index records no remote copies
                        self.placement.lost(ev.key, name)
            self.placement.reap()
