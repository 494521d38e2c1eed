"""What an eviction order's ``victims`` and ``oldest`` skip: keys given as a collection, or a live test.

A tier that protects keys by state (the host tier's pinned slots) would otherwise build the whole set
of protected keys for every call, which is O(pinned) per evicted block, and O(batch²) for a batch
that reserves one slot at a time while its own reservations count as pins. A :class:`KeyFilter`
answers ``key in filter`` from the tier's own maps instead, so a call costs what it visits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Iterable
from typing import Union


class KeyFilter(ABC):
    """A membership test over keys, evaluated when asked (never iterated, never copied)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is to be skipped."""


Exclude = Union[Iterable[bytes], KeyFilter]
"""Keys an order's ``victims`` / ``oldest`` must skip."""


def skip_set(exclude: Exclude) -> Container[bytes]:
    """``exclude`` as something to test candidates against: sets and :class:`KeyFilter` as they are,
    any other iterable copied into a set once. Changes nothing."""
    if isinstance(exclude, (set, frozenset, KeyFilter)):
        return exclude
    return set(exclude)
