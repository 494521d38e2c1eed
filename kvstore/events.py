"""Store events: what happened to which block, queued for a caller to drain.

Metrics and the daemon read from here instead of registering callbacks in hot
loops (vLLM's KV events).
"""

from __future__ import annotations

import threading
from collections import deque
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
    """A bounded, thread-safe FIFO of :class:`StoreEvent` (oldest dropped when full)."""

    def __init__(self, maxlen: int = 100_000) -> None:
        self._q: deque[StoreEvent] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self.dropped = 0
        """Events discarded because nobody drained the queue in time."""

    def put(self, kind: EventKind, key: bytes, tier: str) -> None:
        """Append one event."""
        with self._lock:
            if len(self._q) == self._q.maxlen:
                self.dropped += 1
            self._q.append(StoreEvent(kind, key, tier))

    def drain(self) -> list[StoreEvent]:
        """Return every queued event, oldest first, and empty the queue."""
        with self._lock:
            out = list(self._q)
            self._q.clear()
        return out
