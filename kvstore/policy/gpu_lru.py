"""The GPU eviction queue: GPU blocks only the cache holds, least recently used first.

:class:`~kvstore.store.placement.Placement` owns the one queue of a store
(``Placement.gpu_lru``) because it is the one place a block's evictability
changes: a GPU block is evictable when the index records it, nobody else
holds a reference (``ref_count == 1``) and its radix node is not pinned by a
request. Each of those three facts changes only in a placement method, which
updates the queue, so choosing a victim is O(1) however many blocks live only
in the lower tiers.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from kvstore.errors import PlacementError


class GpuLru:
    """GPU blocks held only by the cache, least recently used first.

    An ``OrderedDict`` keyed by block id: push, remove from the middle and pop
    the oldest are O(1), like vLLM's ``FreeKVCacheBlockQueue`` (a doubly
    linked list for the same reason). Read it through :meth:`order`.
    """

    def __init__(self) -> None:
        self._q: OrderedDict[int, None] = OrderedDict()
        """The queued block ids (keys only: :meth:`~kvstore.store.placement.Placement.oldest_gpu` finds a block's entry
        in the block map, so that a deferred run's blocks are queued without entries)."""

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, block: int) -> bool:
        return block in self._q

    def push(self, block: int) -> None:
        """Append ``block`` as the most recently used."""
        if block in self._q:
            raise PlacementError(f"GPU block {block} is already queued for eviction")
        self._q[block] = None

    def discard(self, block: int) -> None:
        """Remove ``block`` if queued."""
        self._q.pop(block, None)

    def touch(self, block: int) -> None:
        """Make a queued ``block`` the most recently used (no-op if not queued)."""
        if block in self._q:
            self._q.move_to_end(block)

    def touch_all(self, blocks: Iterable[int | None]) -> None:
        """:meth:`touch` each of ``blocks`` in order (the last becomes the most recent); ``None`` and blocks
        not queued are skipped. One pass in C: a lookup touches every block of a prompt (8192 at 128k)."""
        q = self._q
        queued: Iterable[int] = filter(q.__contains__, blocks)  # type: ignore[arg-type]  # None is never queued
        deque(map(q.move_to_end, queued), maxlen=0)

    def oldest(self) -> int | None:
        """The least recently used queued block, without removing it."""
        for block in self._q:
            return block
        return None

    def order(self) -> list[int]:
        """Queued block ids, least recently used first (a copy)."""
        return list(self._q)
