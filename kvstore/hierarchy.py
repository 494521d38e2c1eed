"""The parts of the tiered store that its components share, and the bookkeeping they all need.

:class:`Hierarchy` holds the radix index, the GPU pool, the lower tiers, the
event queue, the counters and the one lock that serialises index changes. It
is passed explicitly to the spiller and the prefetcher (no globals) and owns
the two operations both need: applying tier events to the index, and
removing blocks whose last copy is gone.

Reference counts: the index holds one reference on every GPU block it
records; a lease or an engine sequence holds its own. A GPU block whose
count is 1 is therefore cached but unused, and may be evicted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvstore.errors import BlockStateError
from kvstore.events import EventQueue
from kvstore.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout
from kvstore.radix import BlockEntry, RadixIndex, RadixNode
from kvstore.tiers.base import Tier


@dataclass
class StoreCounters:
    """Store-level counters (tier-level ones live in each tier's ``TierStats``)."""

    lookups: int = 0
    prompt_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "host": 0, "disk": 0})
    """Tokens of looked-up prompts found in each tier (fastest copy)."""
    loaded_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    """Blocks brought up to the GPU from each tier by prefetches."""
    load_failures: int = 0
    """Blocks a prefetch planned but could not load (gone, corrupt, no room)."""
    gpu_evictions: int = 0
    spilled_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    """Blocks copied down by eviction or by the write policy."""
    dropped_blocks: int = 0
    """Blocks removed from the index because no tier held them any more."""


class Hierarchy:
    """Shared state of one tiered store. Hold :attr:`lock` while touching the index or the pool."""

    def __init__(
        self,
        layout: KVLayout,
        pool: GPUBlockPool,
        host: Tier | None,
        disk: Tier | None,
    ) -> None:
        if pool.layout != layout:
            raise ValueError("the GPU pool's layout differs from the store's")
        self.layout = layout
        self.pool = pool
        self.host = host
        self.disk = disk
        self.index = RadixIndex(layout)
        self.events = EventQueue()
        self.counters = StoreCounters()
        self.lock = threading.RLock()
        self._homeless: dict[bytes, BlockEntry] = {}

    def lower_tiers(self) -> list[tuple[str, Tier]]:
        """``[("host", tier), ("disk", tier)]`` for the tiers that exist."""
        out: list[tuple[str, Tier]] = []
        if self.host is not None:
            out.append(("host", self.host))
        if self.disk is not None:
            out.append(("disk", self.disk))
        return out

    # ------------------------------------------------------------ tier events
    def sync_tier_events(self) -> None:
        """Apply what the lower tiers did on their own (capacity evictions, corrupt drops) to the index."""
        with self.lock:
            for name, tier in self.lower_tiers():
                for ev in tier.drain_events():
                    self.events.put("corrupt" if ev.kind == "corrupt" else "evicted", ev.key, name)
                    entry = self.index.get(ev.key)
                    if entry is None:
                        continue
                    if name == "host":
                        self.index.set_host(entry, None)
                    else:
                        self.index.set_disk(entry, False)
                    if entry.tier is None:
                        self.drop_from(entry)
            self.reap()

    # --------------------------------------------------------------- removal
    def drop_from(self, entry: BlockEntry) -> bool:
        """Remove ``entry`` and every block after it in the index (their prefix is broken).

        Frees the index's GPU references and host slots of what it removes.
        When a request holds any of those nodes the removal is deferred to
        :meth:`reap` and ``False`` is returned; the entry then ends every match.
        """
        node = entry.node
        if node is None:
            return True
        subtree = self._subtree(node)
        if any(n.lock_ref for n in subtree):
            self._homeless[entry.key] = entry
            return False
        for n in reversed(subtree[1:]):  # children before parents
            self._release_all(list(n.entries))
            self.index.remove_leaf(n)
        keep = node.entries.index(entry)
        self._release_all(self.index.remove_tail(node, keep))
        self._homeless.pop(entry.key, None)
        return True

    def reap(self) -> None:
        """Retry deferred removals whose nodes are no longer locked."""
        for key, entry in list(self._homeless.items()):
            if entry.node is None:
                self._homeless.pop(key, None)
            elif entry.tier is not None:
                self._homeless.pop(key, None)  # it found a home again
            else:
                self.drop_from(entry)

    def _subtree(self, node: RadixNode) -> list[RadixNode]:
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def _release_all(self, entries: list[BlockEntry]) -> None:
        for e in entries:
            if e.gpu_block is not None:
                self.pool.free([e.gpu_block])
                e.gpu_block = None
            if e.host_slot is not None and self.host is not None:
                try:
                    self.host.delete([e.key])
                except BlockStateError:
                    pass  # a copy in flight holds the slot; it stays as an unindexed, evictable block
                e.host_slot = None
            self.counters.dropped_blocks += 1
            self.events.put("dropped", e.key, "index")
