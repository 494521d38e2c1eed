"""Write-behind from the daemon's host tier to its disk tier, on one thread.

A committed block is published in the host tier at once (clients see it) and
queued here with its host slot *locked*, so it can be neither evicted nor
reused before its disk copy exists. The thread takes batches off the queue,
writes them to the disk tier in one ``put`` (one LMDB transaction), then hands
the keys back to ``unlock``. :meth:`WriteBehind.drain` waits until every
queued block has been written: that, followed by the disk tier's ``flush``,
is what makes FLUSH durable.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

from kvstore.tiers.base import Tier
from kvstore.tiers.host import HostTier

log = logging.getLogger(__name__)


class WriteBehind:
    """Copies locked host slots down to ``disk`` in batches of up to ``batch`` blocks."""

    def __init__(self, host: HostTier, disk: Tier, unlock: Callable[[list[bytes]], None], batch: int = 64) -> None:
        self.host, self.disk, self._unlock, self.batch = host, disk, unlock, batch
        self._queue: deque[tuple[bytes, int]] = deque()
        self._cond = threading.Condition()
        self._in_flight = 0
        self._closing = False
        self.written = 0
        """Blocks written to disk so far."""
        self.failed = 0
        """Blocks the disk tier refused or failed to write (they stay in the host tier only)."""
        self._thread = threading.Thread(target=self._run, name="kvstore-daemon-writer", daemon=True)
        self._thread.start()

    def submit(self, items: Sequence[tuple[bytes, int]]) -> None:
        """Queue ``(key, slot)`` pairs whose host slots the caller has locked; the thread unlocks them."""
        if not items:
            return
        with self._cond:
            if self._closing:
                raise RuntimeError("write-behind queue is closed")
            self._queue.extend(items)
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Blocks queued or being written now."""
        with self._cond:
            return len(self._queue) + self._in_flight

    def drain(self) -> None:
        """Block until every block submitted before this call has been written (or has failed)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and self._in_flight == 0)

    def close(self) -> None:
        """Drain, then stop the thread. Later :meth:`submit` calls raise."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                todo = [self._queue.popleft() for _ in range(min(self.batch, len(self._queue)))]
                self._in_flight = len(todo)
            keys = [k for k, _ in todo]
            try:
                ok = self.disk.put(keys, [self.host.slot_view(s) for _, s in todo])
                done = sum(ok)
            except Exception:  # the blocks stay served from host; the failure is counted and logged
                log.exception("write-behind of %d blocks to the %s tier failed", len(todo), self.disk.name)
                done = 0
            finally:
                self._unlock(keys)
            with self._cond:
                self.written += done
                self.failed += len(todo) - done
                self._in_flight = 0
                self._cond.notify_all()
