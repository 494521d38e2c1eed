"""Use counts of blocks that left every tier, remembered for a while (a placement policy's ``use_memory``).

With a placement policy's ``carry_uses`` a block's use count lives in its index entry and
seeds the GDSF order of each tier it enters. When the block leaves every
tier its entry, and the count, are dropped; if the block comes back (a
popular document recomputed after a burst of other traffic) it restarts at
one use and is the first victim again. :class:`UseMemory` keeps the counts
of the most recently dropped blocks, a bounded number of them, so a block
that comes back within that window resumes its count: the frequency memory
that S3-FIFO's ghost queue gives S3-FIFO, and TinyLFU's sketch gives its
admission, here for GDSF priorities.

A plain ``OrderedDict`` from key to uses, oldest forgotten first: an entry
is a 32-byte key and an int (about 100 bytes with the dict's overhead),
against a KV block of 64 KiB - 2 MiB, so remembering 4x the lower tiers'
blocks costs 0.02-0.6 % of their size in RAM. Exact rather than a sketch
(a count-min sketch would save that RAM at the price of over-counts, which
here would keep blocks that are not popular).

Not thread-safe; :class:`~kvstore.store.placement.Placement` calls it under the
hierarchy's lock. :func:`use_memory_for` sizes a store's from its config and tiers.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.layout import KVLayout
    from kvstore.tiers.base import Tier
    from kvstore.tiers.host.tier import HostTier


class UseMemory:
    """The use counts of up to ``capacity`` blocks no tier holds any more, the most recently dropped kept."""

    def __init__(self, capacity: int) -> None:
        """``capacity``: most keys remembered (0: remember nothing)."""
        if capacity < 0:
            raise ValueError(f"UseMemory capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._uses: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._uses)

    def __contains__(self, key: object) -> bool:
        return key in self._uses

    def uses_of(self, key: bytes) -> int | None:
        """The remembered count of ``key``, or ``None``. Changes nothing."""
        return self._uses.get(key)

    def remember(self, key: bytes, uses: int) -> None:
        """``key`` left every tier after ``uses`` uses: keep the count as the newest, forgetting the oldest
        beyond :attr:`capacity`."""
        if self.capacity == 0 or uses <= 0:
            return
        self._uses.pop(key, None)
        self._uses[key] = uses
        while len(self._uses) > self.capacity:
            self._uses.popitem(last=False)

    def recall(self, key: bytes) -> int:
        """The count ``key`` had when it was dropped (0 if not remembered), forgotten here: it lives in the
        block's index entry again."""
        return self._uses.pop(key, 0)


def use_memory_for(multiple: float, layout: KVLayout, host: HostTier | None, disk: Tier | None) -> UseMemory | None:
    """A store's :class:`UseMemory`, sized ``multiple`` (the placement policy's ``use_memory``) x the host and
    disk capacity in blocks (``None`` when 0)."""
    if multiple <= 0:
        return None
    blocks = sum(t.stats().capacity_bytes // layout.bytes_per_block for t in (host, disk) if t is not None)
    return UseMemory(int(multiple * blocks))
