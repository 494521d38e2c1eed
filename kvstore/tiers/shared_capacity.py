"""One capacity for several tiers of one kind: a daemon serving several KV layouts, a tier of each per layout.

Each layout's block has its own size, so each layout has its own host arena of fixed-size slots and its own
LMDB environment. Together they must hold no more than the one ``host.capacity`` and the one
``disk.max_size`` configured, and capacity should go to whichever layout is being used. The host arenas are
sparse (sized to the whole budget, their pages given back to the kernel whenever a slot is freed:
:meth:`~kvstore.tiers.host.arena.HostArena.release_slots`) and count their slots here (:meth:`take`,
:meth:`give`); an LMDB tier reads the others' usage (:meth:`others_used`) to know its share. A tier that finds
the budget spent takes room from the tiers used less recently than itself first (a layout nobody asks for
gives way to the one in use: :meth:`reclaim` with ``idler_than``), then evicts its own least valuable blocks,
then asks any other tier. A tier sheds without waiting for its lock (two tiers reclaiming from each other
never deadlock: one of them finds the other busy and the put it serves stores fewer blocks, a miss later,
never an error).
"""

from __future__ import annotations

import threading
from typing import Protocol


class Shedding(Protocol):
    """A tier as the budget sees it."""

    def shed(self, nbytes: int) -> int:
        """Evict unpinned blocks worth at least ``nbytes`` if the tier's lock is free now; bytes freed."""
        ...

    def used_bytes(self) -> int:
        """Bytes of this tier's blocks."""
        ...

    @property
    def last_use(self) -> float:
        """``time.monotonic()`` of this tier's last read or write."""
        ...


class SharedCapacity:
    """``limit`` bytes shared by the tiers that :meth:`join` it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()
        self._tiers: list[Shedding] = []

    def join(self, tier: Shedding) -> None:
        """Count ``tier``'s slots against this budget from now on (it starts empty)."""
        with self._lock:
            self._tiers.append(tier)

    def leave(self, tier: Shedding) -> None:
        """Stop counting a closed tier (its slots are gone with its arena)."""
        with self._lock:
            if tier in self._tiers:
                self._tiers.remove(tier)
            self.used -= tier.used_bytes()

    def take(self, count: int, size: int) -> int:
        """Grant up to ``count`` slots of ``size`` bytes; how many were granted."""
        with self._lock:
            n = max(0, min(count, (self.limit - self.used) // size))
            self.used += n * size
            return n

    def give(self, count: int, size: int) -> None:
        """Return ``count`` freed slots of ``size`` bytes."""
        with self._lock:
            self.used -= count * size

    def others_used(self, asking: Shedding) -> int:
        """Bytes the other tiers hold now (read without their locks: a moment's estimate)."""
        with self._lock:
            others = [t for t in self._tiers if t is not asking]
        return sum(t.used_bytes() for t in others)

    def reclaim(self, nbytes: int, asking: Shedding, idler_than: float | None = None) -> int:
        """Ask the other tiers, the least recently used first, to shed ``nbytes`` (with ``idler_than``: only those
        last used before that time); bytes freed (possibly fewer, even 0)."""
        with self._lock:
            others = sorted((t for t in self._tiers if t is not asking
                             and (idler_than is None or t.last_use < idler_than)), key=lambda t: t.last_use)
        freed = 0
        for tier in others:
            if freed >= nbytes:
                break
            freed += tier.shed(nbytes - freed)
        return freed
