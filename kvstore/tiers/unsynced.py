"""Bytes a tier has committed but not yet fsynced, counted across threads, so that it syncs once enough are pending."""

from __future__ import annotations

import threading


class UnsyncedBytes:
    """A thread-safe count of committed bytes not synced yet (starts at 0)."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> int:
        """Count ``nbytes`` more; returns the bytes pending now (the caller compares them with its threshold)."""
        with self._lock:
            self._n += nbytes
            return self._n

    def pending(self) -> int:
        """Bytes counted and not synced yet. Changes nothing."""
        with self._lock:
            return self._n

    def synced(self, nbytes: int) -> None:
        """A sync made ``nbytes`` durable (what :meth:`pending` said before it; bytes added since stay counted)."""
        with self._lock:
            self._n -= min(nbytes, self._n)

    def clear(self) -> None:
        """A sync made everything counted durable."""
        with self._lock:
            self._n = 0
