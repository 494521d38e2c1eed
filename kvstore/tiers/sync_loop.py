"""A background thread that runs a tier's periodic work (syncs, access times) every interval until stopped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvstore.errors import TierError
from kvstore.util.ratelog import RateLimitedLog

log = logging.getLogger(__name__)


class SyncLoop:
    """Calls ``work`` every ``interval_s`` on a daemon thread named ``name`` until :meth:`stop`, and at once
    after :meth:`kick` (a tier with enough unsynced bytes need not wait out the interval).

    A :class:`TierError` from ``work`` is logged (at most once per interval) and the loop goes on: the
    tier's next ``put`` or ``flush`` reports the condition to a caller.
    """

    def __init__(self, work: Callable[[], None], interval_s: float, name: str, what: str | None = None) -> None:
        """Start the thread; ``what`` names the tier's files in the log (default: ``name``)."""
        self._work, self.interval_s, self._what = work, interval_s, what or name
        self._wake = threading.Event()
        self._stopping = False
        self._log = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """Run ``work`` as soon as the thread is free, not at the end of the interval."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread and wait for it (a ``work`` call in progress finishes first). Idempotent."""
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stopping:
                return
            try:
                self._work()
            except TierError as exc:
                self._log.error("sync", "background sync of %s failed: %s", self._what, exc)
