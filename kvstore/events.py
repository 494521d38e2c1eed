"""Store events: what happened to which block, queued for a caller to drain.

Metrics and the daemon read from here instead of registering callbacks in hot
loops (vLLM's KV events).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

EventKind = Literal["stored", "spilled", "loaded", "evicted", "dropped", "corrupt"]


@dataclass(frozen=True)
class StoreEvent:
    """One block changed tiers.

    ``stored``: committed into the index (tier ``gpu``) or written down to a
    lower tier; ``spilled``: copied down because a faster tier evicted it;
    ``loaded``: promoted to a faster tier by a prefetch; ``evicted``: removed
    from a tier for capacity; ``dropped``: removed from the index entirely;
    ``corrupt``: a stored copy failed verification and was deleted.
    """

    kind: EventKind
    key: bytes
    tier: str


class EventQueue:
    """A bounded, thread-safe FIFO of :class:`StoreEvent` (oldest dropped when full).

    Events put together are kept as one record ``(kind, keys, tier)`` and become
    :class:`StoreEvent` objects only when drained: a commit of a 128k-token prompt
    stores 8192 blocks, and building 8192 frozen objects under the store's lock
    cost more than the index insert itself.
    """

    def __init__(self, maxlen: int = 100_000) -> None:
        if maxlen <= 0:
            raise ValueError(f"EventQueue maxlen must be positive, got {maxlen}")
        self.maxlen = maxlen
        self._q: deque[tuple[EventKind, tuple[bytes, ...], str]] = deque()
        self._len = 0  # events queued (the sum of the records' key counts)
        self._lock = threading.Lock()
        self.dropped = 0
        """Events discarded because nobody drained the queue in time."""

    def __len__(self) -> int:
        return self._len

    def put(self, kind: EventKind, key: bytes, tier: str) -> None:
        """Append one event."""
        self.put_many(kind, (key,), tier)

    def put_many(self, kind: EventKind, keys: Sequence[bytes], tier: str) -> None:
        """Append one event per key, in order, all of ``kind`` in ``tier`` (one record; O(1) but the copy of ``keys``)."""
        batch = tuple(keys)
        if not batch:
            return
        with self._lock:
            self._q.append((kind, batch, tier))
            self._len += len(batch)
            over = self._len - self.maxlen
            while over > 0:  # drop the oldest events, whole records first
                k, ks, t = self._q[0]
                if len(ks) <= over:
                    self._q.popleft()
                    gone = len(ks)
                else:
                    self._q[0] = (k, ks[over:], t)
                    gone = over
                self.dropped += gone
                self._len -= gone
                over -= gone

    def drain(self) -> list[StoreEvent]:
        """Return every queued event, oldest first, and empty the queue."""
        with self._lock:
            records = list(self._q)
            self._q.clear()
            self._len = 0
        return [StoreEvent(kind, key, tier) for kind, keys, tier in records for key in keys]
