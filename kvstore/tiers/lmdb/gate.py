"""A readers/resizer gate for one LMDB environment.

py-lmdb's ``Environment.set_mapsize`` may only run while this process has no
live transaction. Readers pass the gate concurrently; a resize closes it,
waits for the readers inside to leave, resizes, and reopens it. (LMDB's own
reader table cannot be used for this: it does not block new readers.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ResizeGate:
    """Shared entry for read transactions, exclusive entry for a map resize."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._closed = False

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the gate open for one read transaction (waits only while a resize is running)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._closed)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Block new readers and wait for current ones to finish. The caller must hold no read transaction."""
        with self._cond:
            self._cond.wait_for(lambda: not self._closed)
            self._closed = True
            self._cond.wait_for(lambda: self._readers == 0)
        try:
            yield
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()
