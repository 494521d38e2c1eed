"""A byte budget: bounds the bytes being loaded at once (backpressure for prefetches)."""

from __future__ import annotations

import threading


class ByteBudget:
    """Counting semaphore over bytes.

    ``acquire(n)`` waits until ``n`` more bytes fit under ``limit``; a request
    larger than the whole limit proceeds alone (when nothing else is in
    flight) so that it can never wait forever.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"byte budget must be positive, got {limit}")
        self.limit = limit
        self._used = 0
        self._cond = threading.Condition()
        self.waits = 0
        """How many acquisitions had to wait (backpressure events)."""

    @property
    def in_flight(self) -> int:
        """Bytes currently acquired."""
        return self._used

    def acquire(self, n: int, timeout: float | None = None) -> bool:
        """Take ``n`` bytes, waiting up to ``timeout`` seconds; returns whether they were taken."""
        with self._cond:
            fits = lambda: self._used + n <= self.limit or self._used == 0  # noqa: E731
            if not fits():
                self.waits += 1
                if not self._cond.wait_for(fits, timeout):
                    return False
            self._used += n
            return True

    def release(self, n: int) -> None:
        """Return ``n`` bytes and wake waiters."""
        with self._cond:
            if n > self._used:
                raise ValueError(f"releasing {n} bytes but only {self._used} in flight")
            self._used -= n
            self._cond.notify_all()
