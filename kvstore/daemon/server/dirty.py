"""The daemon's dirty blocks: committed to its host tier, not yet written to its disk tier.

Under ``policy.write: write_back`` (and ``write_through_selective`` until a block's hits make it due) a
committed block is published in host and *not* written at commit, so host and disk hold distinct blocks
and the same RAM and disk hold more of the working set. Such a block is *dirty*: its host slot stays pinned
(a pinned slot is never evicted, so a dirty block cannot leave host without a disk copy) until the
write-behind thread has written it; then it is clean, and evictable like any other.

Like an operating system's page cache, the daemon writes dirty blocks back *ahead* of need: when the host
tier's clean room (slots holding no reference: free slots and clean published ones, which a reserve may
evict) falls below a low-water mark, the coldest dirty blocks, in the host tier's own eviction order, are
queued to the writer in one batch, so a reserve finds room without waiting for a disk write. A reserve
that still finds too little room writes back what it lacks itself, and waits (:meth:`DirtyBlocks.coldest`).

Every method is called with the backend's mutex held; this object owns only which keys are dirty and
which are being written, never a slot's pin (the backend pins and the writer unpins).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.lower.write_policy import WriteRule
from kvstore.policy.exclude import KeyFilter
from kvstore.tiers.host.tier import HostTier

LOW_WATER_SHARE = 8
"""Write back ahead once fewer than 1/LOW_WATER_SHARE of the host slots are clean room. A put or a disk load
takes a few slots at a time, and the writer needs a batch's disk write to free them: an eighth of the
arena covers the reserves that arrive meanwhile without a reserve having to wait for the disk."""
HIGH_WATER_SHARE = 4
"""A write-back pass queues dirty blocks until 1/HIGH_WATER_SHARE of the host slots are clean room (counting
those being written). The gap to the low-water mark makes a pass come every slots/8 commits or so, with a
batch for the writer each time, not one block per commit. A pass walks the eviction order from its coldest
end only until it has its batch (dirty blocks are pinned, so the coldest keys are mostly dirty ones)."""


class DirtyBlocks:
    """Which of a host tier's published blocks no disk holds yet, and which of those are being written."""

    def __init__(self, rule: WriteRule) -> None:
        self.rule = rule
        self._dirty: dict[bytes, int] = {}
        """Dirty key -> hits since its commit (counted only under ``write_through_selective``)."""
        self._writing: set[bytes] = set()
        """Keys queued to the writer (still pinned) and not yet reported written."""
        self.cleaned_ahead = 0
        """Blocks queued because host clean room fell below the low-water mark (not a flush, not a hit)."""
        self.written_on_hits = 0
        """Blocks queued because their hits reached ``selective_hits``."""

    def __len__(self) -> int:
        """Blocks dirty or being written (each holds a pinned host slot)."""
        return len(self._dirty) + len(self._writing)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is dirty and not being written."""
        return key in self._dirty

    @property
    def writing(self) -> int:
        """Blocks queued to the writer and not yet written."""
        return len(self._writing)

    def add(self, keys: Sequence[bytes]) -> None:
        """``keys`` were just committed and pinned, not queued: dirty from now on."""
        for key in keys:
            assert key not in self._dirty and key not in self._writing, "a dirty block committed again"
            self._dirty[key] = 0

    def discard(self, key: bytes) -> bool:
        """Forget dirty ``key`` (deleted: nothing left to write); whether it was dirty and not being written
        (the caller then unpins its slot)."""
        return self._dirty.pop(key, None) is not None

    def hit(self, keys: Sequence[bytes]) -> list[bytes]:
        """Lookups found ``keys``: count a hit of each dirty one; return those now due (:meth:`WriteRule.due_on_hit`),
        moved to *being written* (the caller queues them)."""
        if not self.rule.counts_hits or not self._dirty:
            return []
        due = []
        for key in dict.fromkeys(keys):
            hits = self._dirty.get(key)
            if hits is None:
                continue
            self._dirty[key] = hits + 1
            if self.rule.due_on_hit(hits + 1):
                due.append(key)
        self.written_on_hits += len(self._take(due))
        return due

    def due_for_room(self, host: HostTier) -> list[bytes]:
        """The coldest dirty keys to write back now to bring clean room up to the high-water mark, when it is
        below the low-water mark (:data:`LOW_WATER_SHARE`); moved to *being written* (the caller queues them)."""
        if not self._dirty:
            return []
        slots = host.room_slots
        room = host.clean_room + len(self._writing)
        if room >= max(1, slots // LOW_WATER_SHARE):
            return []
        picked = self.coldest(host, max(1, slots // HIGH_WATER_SHARE) - room)
        self.cleaned_ahead += len(picked)
        return picked

    def coldest(self, host: HostTier, n: int) -> list[bytes]:
        """Up to ``n`` dirty keys, the next the host tier would evict first, moved to *being written*."""
        if n <= 0 or not self._dirty:
            return []
        return self._take(host.oldest(n, exclude=_NotIn(self._dirty)))

    def take_all(self) -> list[bytes]:
        """Every dirty key, moved to *being written* (a flush, a graceful close)."""
        return self._take(list(self._dirty))

    def written(self, keys: Sequence[bytes]) -> None:
        """The writer is done with ``keys`` (stored or failed) and unpinned them: no longer dirty here."""
        self._writing.difference_update(keys)

    def _take(self, keys: list[bytes]) -> list[bytes]:
        for key in keys:
            del self._dirty[key]
        self._writing.update(keys)
        return keys


class _NotIn(KeyFilter):
    """``key in filter``: ``key`` is not dirty (what :meth:`HostTier.oldest` skips to find the coldest dirty
    keys), tested against the live dict rather than a copy of every clean key."""

    __slots__ = ("_keys",)

    def __init__(self, keys: dict[bytes, int]) -> None:
        self._keys = keys

    def __contains__(self, key: object) -> bool:
        return key not in self._keys
