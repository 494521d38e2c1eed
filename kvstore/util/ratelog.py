"""Rate-limited logging: a condition that repeats (a full disk, a flood of refused connections)
is logged once per interval with a count of what was suppressed, never once per event.

::

    limiter = RateLimitedLog(log, interval_s=10.0)
    limiter.warning("disk-full", "write-behind failed: %s", err)   # logged
    limiter.warning("disk-full", "write-behind failed: %s", err)   # counted, not logged
    ... 10 s later ...
    limiter.warning("disk-full", ...)   # logged, with "(3 similar messages suppressed)"

Each *topic* (a short string naming the condition) has its own window, so one
noisy condition does not hide another.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any


class RateLimitedLog:
    """Logs each topic at most once per ``interval_s``; counts what it suppressed in between.

    Thread-safe. ``clock`` is injectable so tests can drive time without sleeping.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.logger, self.interval_s, self._clock = logger, interval_s, clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._mu = threading.Lock()

    def log(self, level: int, topic: str, msg: str, *args: Any, exc_info: bool = False) -> bool:
        """Log ``msg % args`` at ``level`` unless ``topic`` was logged less than ``interval_s`` ago.

        Returns whether the message was emitted. A suppressed message only increments the
        topic's counter; the next emitted one says how many were suppressed.
        """
        now = self._clock()
        with self._mu:
            last = self._last.get(topic)
            if last is not None and now - last < self.interval_s:
                self._suppressed[topic] = self._suppressed.get(topic, 0) + 1
                return False
            self._last[topic] = now
            skipped = self._suppressed.pop(topic, 0)
        if skipped:
            msg = f"{msg} ({skipped} similar messages suppressed in the last {self.interval_s:g} s)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, topic: str, msg: str, *args: Any, exc_info: bool = False) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, topic, msg, *args, exc_info=exc_info)

    def error(self, topic: str, msg: str, *args: Any, exc_info: bool = False) -> bool:
        """:meth:`log` at ERROR."""
        return self.log(logging.ERROR, topic, msg, *args, exc_info=exc_info)

    def suppressed(self, topic: str) -> int:
        """How many messages of ``topic`` were suppressed since the last one emitted."""
        with self._mu:
            return self._suppressed.get(topic, 0)
