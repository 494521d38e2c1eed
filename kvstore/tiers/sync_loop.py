"""A background thread that runs a tier's periodic work (syncs, access times) every interval until stopped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvstore.errors import TierError
from kvstore.ratelog import RateLimitedLog

log = logging.getLogger(__name__)


class SyncLoop:
    """Calls ``work`` every ``interval_s`` on a daemon thread named ``name`` until :meth:`stop`.

    A :class:`TierError` from ``work`` is logged (at most once per interval) and the loop goes on: the
    tier's next ``put`` or ``flush`` reports the condition to a caller.
    """

    def __init__(self, work: Callable[[], None], interval_s: float, name: str) -> None:
        """Start the thread."""
        self._work, self.interval_s = work, interval_s
        self._stopping = threading.Event()
        self._log = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (a ``work`` call in progress finishes first). Idempotent."""
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            try:
                self._work()
            except TierError as exc:
                self._log.error("sync", "background sync (%s) failed: %s", self._thread.name, exc)
