"""One capacity for several tiers of one kind: a daemon serving several KV layouts, a tier of each per layout.

Each layout's block has its own size, so each layout has its own host arena of fixed-size slots and its own
LMDB environment. Together they must hold no more than the one ``host.capacity`` and the one
``disk.max_size`` configured, and capacity should go to whichever layout is being used. The host arenas are
sparse (sized to the whole budget, their pages given back to the kernel whenever a slot is freed:
:meth:`~kvstore.tiers.host.arena.HostArena.release_slots`) and count their slots here (:meth:`take`,
:meth:`give`); an LMDB tier reads the others' usage (:meth:`others_used`) to know its share.

A tier that finds the budget spent takes room from the tiers used less recently than itself first (a layout
nobody asks for gives way to the one in use: :meth:`reclaim` with ``idler_than``, which never waits), then
evicts its own least valuable blocks, then asks any other tier with :meth:`reclaim_waiting`, which waits up
to :attr:`SharedCapacity.wait_s` for a busy tier's lock. Waiting matters: once the budget is full (a cache's
normal state) a layout flooded by writers holds its locks most of the time, and a tier that asked only while
a lock happened to be free would leave a quieter layout without room for the blocks it had already
acknowledged (puts refused, write-behind failing, FLUSH reporting them not durable). Evicting another
layout's unpinned blocks for such a write is always allowed; pinned blocks (being read, or acknowledged and
waiting for their disk write) are never taken.

The callers hold their own tier's lock while they reclaim, so waiting could deadlock two tiers reclaiming
from each other. It cannot: a tier waits for another only when that wait closes no cycle of waits (this
budget records who waits for whom), the one that would close it only tries the lock once, and every wait
ends at its deadline anyway. A write that still finds no room in time stores fewer blocks: a put reports them
not stored, a write-behind counts them not durable, and FLUSH says so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

RECLAIM_WAIT_S = 1.0
"""How long, all told, a tier short of room waits for busy tiers' locks in :meth:`SharedCapacity.reclaim_waiting`.
Long enough to get between a flooding layout's steps (each holds its locks for a commit or a copy, milliseconds);
short enough that the caller, which holds its own tier's lock meanwhile, stalls that tier's other users briefly.
The disk budget's: an LMDB write waiting holds only its own write lock, on the write-behind thread."""
HOST_RECLAIM_WAIT_S = 0.05
"""The host budget's wait: a host reserve waits holding its layout's backend mutex, which requests served on
the daemon's event loop take too (``hold_in_host``), so its wait bounds what a flood of another layout can add
to every client's request; a host tier's locks are held for microseconds at a time, so 50 ms finds them free."""


class Shedding(Protocol):
    """A tier as the budget sees it."""

    def shed(self, nbytes: int, wait_s: float = 0.0) -> int:
        """Evict unpinned blocks worth at least ``nbytes``, waiting up to ``wait_s`` seconds for the tier's
        lock (``0``: only if it is free now; a busy tier sheds nothing); bytes freed."""
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

    def __init__(self, limit: int, wait_s: float = RECLAIM_WAIT_S) -> None:
        self.limit = limit
        self.used = 0
        self.wait_s = wait_s
        """The longest :meth:`reclaim_waiting` waits for busy tiers (:data:`RECLAIM_WAIT_S`)."""
        self._lock = threading.Lock()
        self._tiers: list[Shedding] = []
        self._waits_for: dict[Shedding, Shedding] = {}
        """A tier whose writer waits now for another tier's lock -> that tier (the wait graph, kept acyclic)."""

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
        """Ask the other tiers, the least recently used first, to shed ``nbytes`` if their locks are free now
        (with ``idler_than``: only those last used before that time); bytes freed (possibly fewer, even 0).
        Never waits: for room a tier may do without (it can evict its own blocks instead)."""
        freed = 0
        for tier in self._others(asking, idler_than):
            if freed >= nbytes:
                break
            freed += tier.shed(nbytes - freed)
        return freed

    def reclaim_waiting(self, lacking: Callable[[], int], asking: Shedding) -> int:
        """Have the other tiers, the least recently used first, shed until ``asking`` has its room, waiting up to
        :attr:`wait_s` in all for busy ones; returns the bytes it still lacks (0: it has them all).

        ``lacking()`` takes for ``asking`` whatever the budget has free now and returns the bytes still
        missing; it is called first, after every round of shedding (room freed may be taken by another
        writer before the asker sees it: it sheds again), and last. The rounds end when nothing lacks, when a
        round freed nothing (every other tier's blocks pinned, or its lock not had in time) or at the deadline.
        """
        deadline = time.monotonic() + self.wait_s
        short = lacking()
        while short > 0:
            freed = 0
            for tier in self._others(asking, None):
                if freed >= short:
                    break
                freed += self._shed_waiting(tier, short - freed, asking, deadline)
            short = lacking()
            if not freed or time.monotonic() >= deadline:
                break
        return short

    def _shed_waiting(self, tier: Shedding, nbytes: int, asking: Shedding, deadline: float) -> int:
        """``tier.shed(nbytes)``, waiting until ``deadline`` unless that wait would close a cycle of waits
        (``tier`` waits, through others perhaps, for ``asking``): then only if its lock is free now."""
        with self._lock:
            end = tier
            while end is not asking and end in self._waits_for:
                end = self._waits_for[end]
            waits = end is not asking
            if waits:
                self._waits_for[asking] = tier
        try:
            return tier.shed(nbytes, max(0.0, deadline - time.monotonic()) if waits else 0.0)
        finally:
            if waits:
                with self._lock:
                    del self._waits_for[asking]

    def _others(self, asking: Shedding, idler_than: float | None) -> list[Shedding]:
        """The tiers other than ``asking`` (with ``idler_than``: last used before it), least recently used first."""
        with self._lock:
            return sorted((t for t in self._tiers if t is not asking
                           and (idler_than is None or t.last_use < idler_than)), key=lambda t: t.last_use)
