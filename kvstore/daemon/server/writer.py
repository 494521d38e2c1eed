"""Write-behind from the daemon's host tier to its disk tier, on one thread.

A committed block is published in the host tier at once (clients see it) and
queued here with its host slot *pinned*, so it can be neither evicted nor
reused before its disk copy exists: at commit under ``policy.write:
write_through``, or later, still pinned, when the backend writes a dirty block
back (:mod:`kvstore.daemon.server.dirty`: host room low, enough hits, a flush, a
close). The thread takes batches off the queue, writes them to the disk tier
in one ``put`` (one LMDB transaction), then hands the keys back to ``unpin``. :meth:`WriteBehind.drain` waits until every
queued block has been written: that, followed by the disk tier's ``flush``,
is what makes FLUSH durable.

A submitter may also *wait* for its own blocks (``disk.sync: always``): the
thread takes whatever is queued, from every waiting client, into one batch,
so concurrent puts share one transaction and one fsync (group commit).

A block whose write fails (full disk, I/O error, a block the tier refuses)
stays in the host tier, unpinned, and is counted. If its submitter waited, it
learns which keys failed and is told they are not stored; otherwise the put
was already acknowledged, and the block counts in :attr:`WriteBehind.not_durable`,
which FLUSH reports, and its key stays listed (:meth:`WriteBehind.lost_among`) until
a later write of it succeeds: a client that puts it again after a failed FLUSH
is not told "already stored" while only RAM holds it (the backend queues the
host copy again). The failure is logged once per interval, never per block.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.util.ratelog import RateLimitedLog
from kvstore.tiers.base import Tier
from kvstore.tiers.host.tier import HostTier

log = logging.getLogger(__name__)
FAILURE_LOG_INTERVAL_S = 10.0
"""At most one log line per this many seconds about failed disk writes (a full disk fails every batch)."""


@dataclass
class _Waiter:
    """One waiting :meth:`WriteBehind.submit` call: how many of its blocks are still queued, which failed."""

    remaining: int
    failed: list[bytes] = field(default_factory=list)


class WriteBehind:
    """Copies pinned host slots down to ``disk`` in batches of up to ``batch`` blocks."""

    def __init__(self, host: HostTier, disk: Tier, unpin: Callable[[list[bytes]], None], batch: int = 64,
                 failure_log: RateLimitedLog | None = None,
                 on_written: Callable[[list[bytes]], None] | None = None) -> None:
        """``on_written``: called on the writer thread with the keys of each batch that reached the disk tier
        (before their waiters are told), e.g. to publish them as KV events."""
        self.host, self.disk, self._unpin, self.batch = host, disk, unpin, batch
        self._on_written = on_written
        self._queue: deque[tuple[bytes, int, _Waiter | None]] = deque()
        self._cond = threading.Condition()
        self._in_flight = 0
        self._pending: dict[bytes, int] = {}  # key -> queued or in-flight copies of it
        self._closing = False
        self._failure_log = failure_log or RateLimitedLog(log, FAILURE_LOG_INTERVAL_S)
        self.written = 0
        """Blocks written to disk so far."""
        self.failed = 0
        """Blocks the disk tier refused or failed to write (they stay in the host tier only)."""
        self.not_durable = 0
        """Of :attr:`failed`, the blocks whose put had already been acknowledged (nobody waited for them)."""
        self._lost: set[bytes] = set()
        """Keys of acknowledged blocks whose latest write failed and that no write has stored since."""
        self.last_error = ""
        """Why the latest failed batch failed (empty until one fails)."""
        self._thread = threading.Thread(target=self._run, name="kvstore-daemon-writer", daemon=True)
        self._thread.start()

    def submit(self, items: Sequence[tuple[bytes, int]], wait: bool = False) -> list[bytes]:
        """Queue ``(key, slot)`` pairs whose host slots the caller has pinned; the thread unpins them.

        With ``wait``, return once every one of them has been written (in a batch shared with other
        waiting callers), with the keys whose write failed; without, return ``[]`` at once.
        """
        if not items:
            return []
        waiter = _Waiter(len(items)) if wait else None
        with self._cond:
            if self._closing:
                raise RuntimeError("write-behind queue is closed")
            self._queue.extend((k, s, waiter) for k, s in items)
            for k, _ in items:
                self._pending[k] = self._pending.get(k, 0) + 1
            self._cond.notify_all()
            if waiter is None:
                return []
            self._cond.wait_for(lambda: waiter.remaining == 0)
        return waiter.failed

    def lost_among(self, keys: Sequence[bytes]) -> list[bytes]:
        """Those of ``keys`` (once each) that were acknowledged and whose latest disk write failed (none
        succeeded since). Every put asks, so the usual answer, none lost at all, takes no lock."""
        if not self._lost:
            return []
        with self._cond:
            return [k for k in dict.fromkeys(keys) if k in self._lost]

    def forget(self, keys: Sequence[bytes]) -> None:
        """Stop listing ``keys`` as lost (they left the host tier: nothing is left to write)."""
        with self._cond:
            self._lost.difference_update(keys)

    @property
    def pending(self) -> int:
        """Blocks queued or being written now."""
        with self._cond:
            return len(self._queue) + self._in_flight

    def is_pending(self, key: bytes) -> bool:
        """Whether ``key`` is queued or being written now (not on disk yet). Changes nothing."""
        with self._cond:
            return key in self._pending

    def drain(self, timeout_s: float | None = None) -> bool:
        """Block until every block submitted before this call has been written (or has failed), or ``timeout_s``
        has passed (``None``: no bound, a FLUSH's wait); whether it drained."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._in_flight == 0, timeout_s)

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
            keys = [k for k, _, _ in todo]
            error = ""
            try:
                ok = self.disk.put(keys, [self.host.slot_view(s) for _, s, _ in todo])
                if not all(ok):
                    error = f"the {self.disk.name} tier refused {len(ok) - sum(ok)} of {len(ok)} blocks"
            except Exception as exc:  # the blocks stay served from host; the failure is counted and logged
                ok = [False] * len(todo)
                error = f"{type(exc).__name__}: {exc}"
            finally:
                self._unpin(keys)
            if self._on_written is not None:
                self._on_written([k for k, stored in zip(keys, ok) if stored])
            with self._cond:
                self._account(todo, ok, error)
                self._in_flight = 0
                self._cond.notify_all()
                not_durable = self.not_durable
                lost = list(self._lost) if len(self._lost) > 2 * self.host.num_slots else []
            if lost:  # bounded: the host tier holds at most num_slots of them, the rest were evicted
                self.forget([k for k in lost if self.host.slot_of(k) is None])
            if error:
                self._failure_log.error(
                    "write-failed", "write-behind to the %s tier failed: %s; %d blocks of this batch not written "
                    "(they stay in the host tier only; %d acknowledged blocks not durable since start)",
                    self.disk.name, error, len(todo) - sum(ok), not_durable,
                )

    def _account(self, todo: list[tuple[bytes, int, _Waiter | None]], ok: list[bool], error: str) -> None:
        """Count one written batch and tell its waiters (condition held)."""
        acked_failures = 0
        for (key, _, waiter), stored in zip(todo, ok):
            left = self._pending[key] - 1
            if left:
                self._pending[key] = left
            else:
                del self._pending[key]
            if stored:
                self._lost.discard(key)
            if waiter is not None:
                waiter.remaining -= 1
                if not stored:
                    waiter.failed.append(key)
            elif not stored:
                acked_failures += 1
                self._lost.add(key)
        done = sum(ok)
        self.written += done
        self.failed += len(todo) - done
        self.not_durable += acked_failures
        if error:
            self.last_error = error
