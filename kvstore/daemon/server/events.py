"""The daemon's KV events: what its host and disk tiers hold, in order, for a router (``daemon.events``).

The engines sharing a daemon can load any block it holds, so a router that
follows the daemon's feed (``kvstore route --store``) counts those blocks for
each of them. Where each event comes from:

- ``stored`` / ``host``: a block published in the host tier (a client's commit
  or inline put, or a disk hit copied up for a reader);
- ``stored`` / ``disk``: the write-behind thread wrote it to the disk tier;
- ``evicted`` / ``corrupt``: the tier's own events (capacity, failed
  verification), which the tiers queue themselves;
- ``evicted`` for a DELETE or a put whose durable write failed (the block
  left that tier).

Order: every append first moves the tiers' own queued events into the one
queue, under one lock, so an eviction the tier queued before a later store of
the same key is published before it. The one race left: a disk eviction of
a key inside the very batch that wrote it is published before that batch's
``stored``; the router then believes the key is on disk until the next full
report (a wrong guess costs a recompute, never a wrong answer).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Literal

from kvstore.events import EventQueue, StoreEvent
from kvstore.tiers.base import Tier

DaemonTierName = Literal["host", "disk"]
"""The daemon's tiers as a router names them."""


class DaemonEvents:
    """One ordered, bounded queue of the daemon's tier changes (the tiers' own events folded in)."""

    def __init__(self, host: Tier, disk: Tier | None, maxlen: int = 100_000) -> None:
        """Turns event recording on in ``host`` and ``disk`` (the daemon keeps it off when nobody drains)."""
        self._tiers: list[tuple[Tier, DaemonTierName]] = [(host, "host")]
        if disk is not None:
            self._tiers.append((disk, "disk"))
        self.queue = EventQueue(maxlen)
        self._lock = threading.Lock()
        for tier, _ in self._tiers:
            tier.record_events(True)

    def stored(self, keys: Sequence[bytes], tier: DaemonTierName) -> None:
        """``keys`` are now in ``tier`` (after whatever the tiers did before)."""
        self._append("stored", keys, tier)

    def removed(self, keys: Sequence[bytes], tier: DaemonTierName) -> None:
        """``keys`` left ``tier`` (a delete, a failed durable write)."""
        self._append("evicted", keys, tier)

    def drain(self) -> list[StoreEvent]:
        """Every event queued since the last drain, oldest first (the tiers' own included)."""
        with self._lock:
            self._pull()
            return self.queue.drain()

    def holdings(self) -> dict[str, list[bytes]]:
        """Every key each tier holds now (a full report). Changes nothing."""
        return {name: tier.keys() for tier, name in self._tiers}

    def _append(self, kind: Literal["stored", "evicted"], keys: Sequence[bytes], tier: DaemonTierName) -> None:
        if not keys:
            return
        with self._lock:
            self._pull()
            self.queue.put_many(kind, keys, tier)

    def _pull(self) -> None:
        """Move the tiers' queued events into :attr:`queue` (lock held)."""
        for tier, name in self._tiers:
            for ev in tier.drain_events():
                self.queue.put("corrupt" if ev.kind == "corrupt" else "evicted", ev.key, name)
