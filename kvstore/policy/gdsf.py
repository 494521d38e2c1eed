"""GDSF eviction order (Greedy-Dual-Size-Frequency, Cherkasova 1998) with accounted sizes.

Each resident key has a priority ``L + w(count)``: ``count`` is the number of
uses the order has seen of it (1 when added), ``w`` the order's
:class:`CountWeight` (``count`` itself by default), and ``L`` is the cache's
*inflation*, the priority of the last key given up as a victim. The victim is
always the key of lowest priority, the oldest use first among equal ones.
Because ``L`` only grows, a key that is not used again sinks below newly
added ones after about ``count`` evictions' worth of inflation: frequency
with aging, so a block used many times long ago does not stay forever and a
block used once (a scan) leaves before one used twice.

:data:`DAMPED` (``adaptive``'s) weighs a count as
``min(count, 8) ** 0.8``: a block's chance of another use rises with its
count, but less than in proportion (the Mooncake trace: 0.26 after one
use, 0.42 after two, 0.58 after four, 0.84 after eight), so a block used
often long ago ages out sooner than under ``count`` itself, and beyond 8
uses more uses buy no more time (measured in docs/BENCHMARKS.md "hitrate").
The weight only orders keys: ``count`` itself is kept whole (:meth:`GDSFIndex.count_of`).

Size does not enter the priority (GDSF's ``cost / size`` factor is 1): the
cost of a KV block, the prefill it saves, is proportional to its bytes.

Prefix closure: every request that uses a block uses its parent too, so a
parent's count is never below its child's while both are resident, and the
tiers touch a prompt's blocks deepest first, so among equal priorities the
deepest block is the oldest use and goes first. A tier thus gives up a
prefix's tail before its head.

A binary heap of ``(priority, use sequence, key)`` with lazy deletion: a use
pushes a new entry and leaves the old one stale (skipped when popped); the
heap is rebuilt when stale entries outnumber live ones. ``victims`` is
O(k log n) for k victims. Not thread-safe; the owning tier holds its lock
around every call.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.policy.exclude import Exclude, skip_set


@dataclass(frozen=True)
class CountWeight:
    """How a use count enters a GDSF priority: ``min(count, cap) ** power`` (``cap`` 0: no cap)."""

    power: float = 1.0
    cap: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.power <= 1 or self.cap < 0:
            raise ValueError(f"need 0 < power <= 1 and cap >= 0, got {self.power}, {self.cap}")

    def __call__(self, count: int) -> float:
        """The weight of ``count`` uses (``count`` itself for :data:`LINEAR`)."""
        if self.cap:
            count = min(count, self.cap)
        return float(count) if self.power == 1 else count ** self.power


LINEAR = CountWeight()
"""``L + count``: GDSF's own priority (``gdsf``'s)."""
DAMPED = CountWeight(power=0.8, cap=8)
"""``L + min(count, 8) ** 0.8`` (``adaptive``'s)."""
WEIGHTS: dict[str, CountWeight] = {"linear": LINEAR, "damped": DAMPED}
"""Count weights by the name a placement policy's ``weight`` uses."""


@dataclass(slots=True)
class _Slot:
    size: int
    count: int
    priority: float
    seq: int


class GDSFIndex:
    """Keys in GDSF order (lowest ``L + w(count)`` first), each with the bytes it is accounted for."""

    def __init__(self, weight: CountWeight = LINEAR) -> None:
        """``weight``: how a count enters the priority (:data:`LINEAR`: ``L + count``)."""
        self.weight = weight
        """The order's :class:`CountWeight`."""
        self._keys: dict[bytes, _Slot] = {}
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = itertools.count(1)
        self._oldest_seq = itertools.count(-1, -1)  # add_oldest: before every use so far
        self.inflation = 0.0
        """``L``: the priority of the last key returned by :meth:`victims` (0 when none yet)."""
        self.used = 0
        """Sum of the accounted sizes."""

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[bytes]:
        """Keys, the next victim first. Changes nothing."""
        return iter(sorted(self._keys, key=lambda k: (self._keys[k].priority, self._keys[k].seq)))

    def priority_of(self, key: bytes) -> float | None:
        """``L + w(count)`` of resident ``key`` as of its last use, or ``None``. Changes nothing."""
        slot = self._keys.get(key)
        return None if slot is None else slot.priority

    def count_of(self, key: bytes) -> int | None:
        """Uses seen of resident ``key`` (1 when added), or ``None``. Changes nothing."""
        slot = self._keys.get(key)
        return None if slot is None else slot.count

    def add(self, key: bytes, size: int) -> None:
        """Insert ``key`` with count 1 (priority ``L + w(1)``); a resident ``key`` only gets its size replaced."""
        slot = self._keys.get(key)
        if slot is not None:
            self.used += size - slot.size
            slot.size = size
            return
        self._insert(key, _Slot(size, 1, self.inflation + self.weight(1), next(self._seq)))

    def add_oldest(self, key: bytes, size: int) -> None:
        """Insert ``key`` with count 1 and priority ``L``, the next victim (replacing it if resident).
        For blocks found on reopen, which have no recorded use; a loader adds them newest first."""
        self.remove(key)
        self._insert(key, _Slot(size, 1, self.inflation, next(self._oldest_seq)))

    def touch(self, key: bytes) -> bool:
        """Count a use of ``key``: count + 1, priority ``L + w(count)`` with today's ``L``. ``False`` if absent."""
        slot = self._keys.get(key)
        if slot is None:
            return False
        slot.count += 1
        slot.priority = self.inflation + self.weight(slot.count)
        slot.seq = next(self._seq)
        self._push(key, slot)
        return True

    def seed(self, key: bytes, uses: int) -> bool:
        """Set resident ``key``'s count to ``uses`` (its uses before it entered this tier), priority ``L + w(uses)``.

        For a count kept outside the tier (the block's index entry), so a block
        demoted from a faster tier keeps its frequency. ``False`` if absent.
        """
        slot = self._keys.get(key)
        if slot is None:
            return False
        slot.count = max(1, uses)
        slot.priority = self.inflation + self.weight(slot.count)
        slot.seq = next(self._seq)
        self._push(key, slot)
        return True

    def remove(self, key: bytes) -> int | None:
        """Forget ``key``; returns its size, or ``None`` if absent. ``L`` is unchanged."""
        slot = self._keys.pop(key, None)
        if slot is None:
            return None
        self.used -= slot.size
        return slot.size

    def size_of(self, key: bytes) -> int | None:
        """Accounted size of ``key``, or ``None``."""
        slot = self._keys.get(key)
        return None if slot is None else slot.size

    def victims(self, need: int, budget: int, exclude: Exclude = ()) -> list[bytes]:
        """Lowest-priority keys whose removal makes ``used + need <= budget``.

        Membership, sizes and ``used`` are unchanged (the caller removes the
        keys once really gone); ``L`` rises to the priority of the last key
        returned, so call it only when about to evict. Keys in ``exclude``
        are skipped. Returns fewer (possibly all keys) if even that is not
        enough; the caller checks the arithmetic.
        """
        skip = skip_set(exclude)
        out: list[bytes] = []
        held: list[tuple[float, int, bytes]] = []
        freed = 0
        while self._heap and self.used - freed + need > budget:
            item = heapq.heappop(self._heap)
            slot = self._keys.get(item[2])
            if slot is None or slot.seq != item[1]:
                continue  # stale: removed, or used again since
            held.append(item)
            if item[2] in skip:
                continue
            out.append(item[2])
            freed += slot.size
            self.inflation = max(self.inflation, slot.priority)
        for item in held:
            heapq.heappush(self._heap, item)
        return out

    def oldest(self, n: int, exclude: Exclude = ()) -> list[bytes]:
        """Up to ``n`` keys not in ``exclude``, the next victim first. Changes nothing."""
        skip = skip_set(exclude)
        live = ((s.priority, s.seq, k) for k, s in self._keys.items() if k not in skip)
        return [k for _, _, k in heapq.nsmallest(n, live)]

    def _insert(self, key: bytes, slot: _Slot) -> None:
        self._keys[key] = slot
        self.used += slot.size
        self._push(key, slot)

    def _push(self, key: bytes, slot: _Slot) -> None:
        heapq.heappush(self._heap, (slot.priority, slot.seq, key))
        if len(self._heap) > 2 * len(self._keys) + 64:
            self._heap = [(s.priority, s.seq, k) for k, s in self._keys.items()]
            heapq.heapify(self._heap)
