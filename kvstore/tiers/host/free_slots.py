"""The host arena's free slots, costing memory for the slots handed out and freed again, not for the arena.

A daemon serving any layout sizes each layout's arena from the shared budget, so a client bringing tiny blocks
would make a list of every slot number (tens of bytes each, built on the event loop) cost gigabytes before it
stored one block. Slots never handed out are one counter instead: the next fresh slot; slots freed again sit on
a list, and are handed out first (the lowest of the latest batch first, see ``HostTier._make_room``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class FreeSlots:
    """Free slot numbers of an arena of ``num_slots`` slots, all free at first."""

    __slots__ = ("num_slots", "_fresh", "_freed")

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._fresh = 0
        """Slots ``_fresh..num_slots-1`` have never been handed out."""
        self._freed: list[int] = []
        """Slots handed out and freed since; :meth:`pop` takes from its end."""

    def __len__(self) -> int:
        return len(self._freed) + self.num_slots - self._fresh

    def __bool__(self) -> bool:
        return bool(self._freed) or self._fresh < self.num_slots

    def __iter__(self) -> Iterator[int]:
        """Every free slot (for integrity checks: costs one entry per free slot)."""
        yield from self._freed
        yield from range(self._fresh, self.num_slots)

    def pop(self) -> int:
        """A free slot, now taken: one freed again if any, else the lowest fresh one. ``IndexError`` if none."""
        if self._freed:
            return self._freed.pop()
        if self._fresh >= self.num_slots:
            raise IndexError("no free host slot")
        self._fresh += 1
        return self._fresh - 1

    def extend(self, slots: Iterable[int]) -> None:
        """Slots freed again, handed out from the last one given here."""
        self._freed.extend(slots)
