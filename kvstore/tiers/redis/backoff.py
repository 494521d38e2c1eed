"""Reconnect back-off for a remote store: after a failure, skip it for a while instead of waiting on it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Backoff:
    """Open after a failure for ``min_s``, doubling per consecutive failure up to ``max_s``; a success closes it.

    While open, :meth:`allow` is ``False``: callers report a miss without a round trip, so a dead or
    failing-over server costs one timeout per window, not one per request.
    """

    def __init__(self, min_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError(f"back-off needs 0 < min_s <= max_s, got {min_s}, {max_s}")
        self.min_s, self.max_s = min_s, max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._until = 0.0
        self._delay = 0.0
        self.failures = 0
        """Failures since the last success."""

    def allow(self) -> bool:
        """Whether a call should reach the server now. Changes nothing."""
        with self._lock:
            return self._clock() >= self._until

    def failed(self) -> float:
        """Record a failure; returns the seconds until the next try."""
        with self._lock:
            self.failures += 1
            self._delay = self.min_s if self._delay == 0 else min(self.max_s, self._delay * 2)
            self._until = self._clock() + self._delay
            return self._delay

    def succeeded(self) -> bool:
        """Record a success; returns whether it ended a run of failures (a reconnect)."""
        with self._lock:
            was_down = self.failures > 0
            self.failures, self._delay, self._until = 0, 0.0, 0.0
            return was_down
