"""S3-FIFO eviction order with accounted sizes (Yang et al., SOSP'23), for the disk and file tiers.

Three FIFO queues, all ``OrderedDict``s from key to accounted bytes, oldest
first (append and pop-first are O(1), and a FIFO never moves a key on a hit,
which is what makes it scan resistant)::

    add ──► small (~10 % of the budget) ──evicted, never re-referenced──► ghost (keys only)
              │ re-referenced (freq >= 1)                                   │ added again
              ▼                                                             ▼
            main ◄──────────────────────────────────────────────────────────┘
              │ head with freq > 0: back to the tail, freq - 1 (second chance)
              ▼ head with freq == 0: evicted

Each resident key has a frequency 0-3, raised by :meth:`touch` and never by
:meth:`add`. A block seen once (a scan, a document read once) passes through
the small queue and leaves without displacing the main queue; a block that
comes back while its key is still in the ghost set goes straight to main.
The small-queue threshold is one re-reference, as the paper's text
says ("accessed at least once"); a promoted block keeps its frequency.

Ghost size, a deliberate departure from the paper: the paper's ghost holds
as many entries as the main queue. Here it remembers the keys of
``GHOST_BUDGETS`` (4) budgets' worth of blocks. A ghost entry is a key and a
size (about 100 bytes of RAM) against a 64 KiB - 2 MiB block, so 4 budgets of
them take 0.02-0.6 % of the tier's size in RAM, and it lets the second visit of a block be seen
after up to 4x the tier's capacity of other insertions: a tier below host
and GPU sees documents and conversations come back after more than its own
capacity, and the paper's ghost forgets them first (measured in
``docs/BENCHMARKS.md``, section hitrate). ``ghost_budgets=0.9`` restores the paper.

The budget is only known when eviction is asked for, so the small queue's
share and the ghost's bound are applied in :meth:`victims`. Not thread-safe;
the owning tier holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from itertools import chain

from kvstore.policy.exclude import Exclude, skip_set

SMALL_FRACTION = 0.1
"""Share of the budget the small queue may hold before eviction takes from it first."""
GHOST_BUDGETS = 4.0
"""Ghost keys kept, in bytes of the blocks they stood for, as a multiple of the budget (see above)."""
MAX_FREQ = 3
"""Frequencies saturate here: at most three second chances in the main queue."""


class S3FIFOIndex:
    """Keys in S3-FIFO order (small, main and ghost queues), each with the bytes it is accounted for."""

    def __init__(self, small_fraction: float = SMALL_FRACTION, ghost_budgets: float = GHOST_BUDGETS,
                 seed_to_main: bool = False, ghost_loaded: bool = False) -> None:
        """``ghost_budgets``: how many budgets of evicted keys the ghost remembers (the paper: main's share);
        ``seed_to_main``: :meth:`seed` with two or more uses moves a small-queue key to main (a block with a
        history from another tier skips the filter, as a ghost hit does); default: seeds are ignored;
        ``ghost_loaded``: :meth:`remove` of a key used since it was added (frequency >= 1: under
        exclusive tiers, a block loaded into the GPU) records it in the ghost, so when it comes
        back it enters main, where a tier that had kept it would have had it; default: a removed key is
        forgotten."""
        if not 0 < small_fraction < 1 or ghost_budgets < 0:
            raise ValueError(f"need 0 < small_fraction < 1 and ghost_budgets >= 0, got {small_fraction}, {ghost_budgets}")
        self.small_fraction = small_fraction
        self.ghost_budgets = ghost_budgets
        self.seed_to_main = seed_to_main
        self.ghost_loaded = ghost_loaded
        self._small: OrderedDict[bytes, int] = OrderedDict()
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._ghost: OrderedDict[bytes, int] = OrderedDict()  # evicted from small: key -> its size
        self._freq: dict[bytes, int] = {}  # resident keys only
        self._small_used = 0
        self._ghost_used = 0
        self.used = 0
        """Sum of the accounted sizes of resident keys (ghosts cost nothing)."""

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __iter__(self) -> Iterator[bytes]:
        """Keys in queue order: the small queue oldest first, then the main queue oldest first."""
        return chain(self._small, self._main)

    def queue_of(self, key: bytes) -> str | None:
        """``"small"``, ``"main"``, ``"ghost"`` or ``None``: where ``key`` is now. Changes nothing."""
        for name, queue in (("small", self._small), ("main", self._main), ("ghost", self._ghost)):
            if key in queue:
                return name
        return None

    def freq_of(self, key: bytes) -> int | None:
        """Frequency (0-3) of a resident ``key``, or ``None``. Changes nothing."""
        return self._freq.get(key)

    def add(self, key: bytes, size: int) -> None:
        """Insert ``key`` with frequency 0: at the main tail if its key is in the ghost set (which forgets
        it), else at the small tail. A resident ``key`` only gets its size replaced (a FIFO keeps its place)."""
        if key in self._small:
            self._small_used += size - self._small[key]
            self.used += size - self._small[key]
            self._small[key] = size
        elif key in self._main:
            self.used += size - self._main[key]
            self._main[key] = size
        elif self._forget_ghost(key):
            self._main[key] = size
            self._freq[key] = 0
            self.used += size
        else:
            self._small[key] = size
            self._small_used += size
            self._freq[key] = 0
            self.used += size

    def add_oldest(self, key: bytes, size: int) -> None:
        """Insert ``key`` with frequency 0 at the main head, the next the main queue evicts (replacing it
        if resident). For blocks found on reopen: they have a history, so they skip the small queue;
        a loader adds them newest first to rebuild the main queue in access order."""
        self.remove(key)
        self._forget_ghost(key)
        self._main[key] = size
        self._main.move_to_end(key, last=False)
        self._freq[key] = 0
        self.used += size

    def touch(self, key: bytes) -> bool:
        """Count a use of ``key`` (frequency + 1, at most 3); it keeps its place. ``False`` if absent."""
        freq = self._freq.get(key)
        if freq is None:
            return False
        self._freq[key] = min(freq + 1, MAX_FREQ)
        return True

    def seed(self, key: bytes, uses: int) -> bool:
        """Uses from before ``key`` entered this tier: ignored (the order keeps only its own frequency), unless
        ``seed_to_main``: then a key in the small queue with ``uses >= 2`` moves to the main tail, frequency
        kept. ``False`` if absent."""
        if self.seed_to_main and uses >= 2 and key in self._small:
            size = self._small.pop(key)
            self._small_used -= size
            self._main[key] = size
        return key in self

    def remove(self, key: bytes) -> int | None:
        """Forget resident ``key``; returns its size, or ``None`` if absent. The ghost set is left as is, unless
        ``ghost_loaded`` and ``key`` was used since added: then it is remembered there (trimmed at the next
        :meth:`victims`)."""
        size = self._small.pop(key, None)
        if size is not None:
            self._small_used -= size
        else:
            size = self._main.pop(key, None)
            if size is None:
                return None
        if self._freq.pop(key) >= 1 and self.ghost_loaded:
            self._remember_ghost(key, size)
        self.used -= size
        return size

    def remove_evicted(self, key: bytes, budget: int) -> int | None:
        """:meth:`remove` ``key`` as a victim another order chose under ``budget`` (a duel's leader): a key in
        the small queue enters the ghost set, as it would had :meth:`victims` returned it, and the ghost is
        trimmed to ``ghost_budgets * budget``; a main key is forgotten (unless ``ghost_loaded``, as by
        :meth:`remove`). Returns its size, or ``None`` if absent."""
        in_small = key in self._small
        size = self.remove(key)
        if size is not None and in_small:
            self._remember_ghost(key, size)
            self._trim_ghost(budget)
        return size

    def size_of(self, key: bytes) -> int | None:
        """Accounted size of resident ``key``, or ``None``."""
        size = self._small.get(key)
        return size if size is not None else self._main.get(key)

    def victims(self, need: int, budget: int, exclude: Exclude = ()) -> list[bytes]:
        """Keys whose removal makes ``used + need <= budget``, chosen by the S3-FIFO walk.

        The walk takes from the small queue's head while the small queue (less what is already
        chosen) holds at least ``small_fraction * budget`` bytes or main is empty, else from the main
        head. It changes the *order*, never membership, sizes or ``used``:

        - a small-queue key with frequency >= 1 that it passes moves to the main tail (frequency kept);
        - a main key with frequency > 0 that it passes moves to the main tail with frequency - 1;
        - each small-queue key it returns enters the ghost set, which is then trimmed (oldest first) to
          ``ghost_budgets * budget`` bytes.

        Returned keys stay resident, at the heads of their queues in the returned order, until the
        caller :meth:`remove`\\ s them (a caller that cannot delete them simply sees them offered first
        next time). Keys in ``exclude`` are skipped and keep their places. Returns fewer (possibly all
        keys) if even that is not enough; the caller checks the arithmetic.
        """
        skip = skip_set(exclude)
        small_share = int(budget * self.small_fraction)
        out: list[bytes] = []
        held_small: list[tuple[bytes, int]] = []  # popped (victims, excluded), put back at the heads
        held_main: list[tuple[bytes, int]] = []
        small_left = self._small_used  # bytes still in small that the walk has not chosen or passed over
        freed = 0
        while self.used - freed + need > budget:
            if self._small and (small_left >= small_share or not self._main):
                key, size = self._small.popitem(last=False)
                small_left -= size
                if key not in skip and self._freq[key] >= 1:
                    self._small_used -= size
                    self._main[key] = size
                    self._forget_ghost(key)  # a victim of an earlier call that was touched before removal
                    continue
                held_small.append((key, size))
                if key not in skip:
                    out.append(key)
                    freed += size
                    self._remember_ghost(key, size)
            elif self._main:
                key, size = self._main.popitem(last=False)
                if key not in skip and self._freq[key] > 0:
                    self._freq[key] -= 1
                    self._main[key] = size
                    continue
                held_main.append((key, size))
                if key not in skip:
                    out.append(key)
                    freed += size
            else:
                break
        for queue, held in ((self._small, held_small), (self._main, held_main)):
            for key, size in reversed(held):
                queue[key] = size
                queue.move_to_end(key, last=False)
        self._trim_ghost(budget)
        return out

    def oldest(self, n: int, exclude: Exclude = ()) -> list[bytes]:
        """Up to ``n`` keys not in ``exclude`` in queue order (small, then main; frequencies ignored).
        Changes nothing."""
        skip = skip_set(exclude)
        out: list[bytes] = []
        for key in self:
            if len(out) >= n:
                break
            if key not in skip:
                out.append(key)
        return out

    def _trim_ghost(self, budget: int) -> None:
        while self._ghost and self._ghost_used > budget * self.ghost_budgets:
            self._ghost_used -= self._ghost.popitem(last=False)[1]

    def _remember_ghost(self, key: bytes, size: int) -> None:
        self._forget_ghost(key)
        self._ghost[key] = size
        self._ghost_used += size

    def _forget_ghost(self, key: bytes) -> bool:
        size = self._ghost.pop(key, None)
        if size is None:
            return False
        self._ghost_used -= size
        return True
