"""Least-recently-used order with accounted sizes, shared by the disk and file tiers.

An ``OrderedDict`` from key to accounted bytes, oldest first: ``move_to_end``
and ``popitem``-style removal are O(1), which is all LRU needs. Not
thread-safe; the owning tier holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvstore.policy.exclude import Exclude, skip_set


class LRUIndex:
    """Keys in least-recently-used order, each with the bytes it is accounted for."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, int] = OrderedDict()
        self.used = 0
        """Sum of the accounted sizes."""

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[bytes]:
        """Keys, least recently used first."""
        return iter(self._order)

    def add(self, key: bytes, size: int) -> None:
        """Insert ``key`` as most recently used (replacing its size if present)."""
        self.remove(key)
        self._order[key] = size
        self.used += size

    def add_oldest(self, key: bytes, size: int) -> None:
        """Insert ``key`` as least recently used (for entries found without a recorded access time)."""
        self.add(key, size)
        self._order.move_to_end(key, last=False)

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` most recently used; ``False`` if absent."""
        if key not in self._order:
            return False
        self._order.move_to_end(key)
        return True

    def seed(self, key: bytes, uses: int) -> bool:
        """Uses from before ``key`` entered this tier: ignored (the order keeps only its own recency). ``False`` if absent."""
        return key in self

    def remove(self, key: bytes) -> int | None:
        """Forget ``key``; returns its size, or ``None`` if absent."""
        size = self._order.pop(key, None)
        if size is not None:
            self.used -= size
        return size

    def size_of(self, key: bytes) -> int | None:
        """Accounted size of ``key``, or ``None``."""
        return self._order.get(key)

    def victims(self, need: int, budget: int, exclude: Exclude = ()) -> list[bytes]:
        """Oldest keys whose removal makes ``used + need <= budget``. Changes nothing.

        Returns fewer (possibly all keys) if even that is not enough; the
        caller checks the arithmetic.
        """
        skip = skip_set(exclude)
        out: list[bytes] = []
        freed = 0
        for key, size in self._order.items():
            if self.used - freed + need <= budget:
                break
            if key in skip:
                continue
            out.append(key)
            freed += size
        return out

    def oldest(self, n: int, exclude: Exclude = ()) -> list[bytes]:
        """Up to ``n`` least recently used keys not in ``exclude``. Changes nothing."""
        skip = skip_set(exclude)
        out: list[bytes] = []
        for key in self._order:
            if len(out) >= n:
                break
            if key not in skip:
                out.append(key)
        return out
