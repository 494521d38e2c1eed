"""A circuit breaker per store endpoint: after repeated deadline misses or errors, stop asking for a while.

An engine that asks a stalled daemon (paused, swapping, a stuck disk under
it) pays one deadline per call; at a scheduler step per request that is
still a stall. The breaker turns repeated misses into instant ones::

    closed ──(``failures`` misses in a row)──► open ──(a background probe answers)──► closed

While it is open every call is a fast miss (``breaker_open``) and nothing is
sent; a background thread probes the endpoint after ``open_s``, doubling the
wait after each failed probe up to ``open_max_s``. Each transition is logged
once, and :meth:`CircuitBreaker.snapshot` gives the state and the
transitions, for ``/metrics``; the caller counts its misses by
:class:`MissReason`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

log = logging.getLogger(__name__)


class MissReason(str, Enum):
    """Why a call into kvstore gave nothing (a lookup counted as a miss, a load recomputed, a save dropped)."""

    DEADLINE = "deadline"
    """The endpoint did not answer within the call's deadline."""
    BREAKER_OPEN = "breaker_open"
    """Not asked: the breaker is open after repeated misses."""
    GONE = "daemon_gone"
    """The connection broke or nothing listens at the address."""
    NO_ROOM = "no_room"
    """The endpoint answered but did not keep the block (its tiers are full of blocks in use)."""
    QUEUE_FULL = "queue_full"
    """A save found the engine's bounded save queue full: dropped without asking."""


@dataclass(frozen=True)
class BreakerSettings:
    """When a breaker opens and how long it stays open (see the module docstring)."""

    failures: int = 3
    """Misses in a row (deadline or error) that open it."""
    open_s: float = 1.0
    """First wait before the background probe."""
    open_max_s: float = 5.0
    """Longest wait between probes (the wait doubles after each failed probe)."""


class CircuitBreaker:
    """The breaker of one endpoint. Thread-safe; ``probe`` runs on a background thread and raises when it fails."""

    def __init__(self, endpoint: str, settings: BreakerSettings, probe: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.settings = settings
        self._probe = probe
        self._clock = clock
        self._lock = threading.Lock()
        self._open_since: float | None = None
        self._in_a_row = 0
        self._opened = 0
        self._closed = 0
        self._probes = 0
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None

    @property
    def is_open(self) -> bool:
        """Whether calls are refused now (a fast miss each)."""
        return self._open_since is not None

    def allow(self) -> bool:
        """Whether a call may go to the endpoint now."""
        return self._open_since is None

    def succeeded(self) -> None:
        """A call was answered in time: the misses in a row start again from 0."""
        self._in_a_row = 0

    def failed(self, reason: MissReason, detail: str) -> None:
        """A call missed (``reason``; ``detail`` for the log); the ``failures``-th in a row opens the breaker."""
        with self._lock:
            self._in_a_row += 1
            if self._open_since is not None or self._in_a_row < self.settings.failures:
                return
            self._open_since = self._clock()
            self._opened += 1
            log.warning("kvstore breaker for %s OPEN after %d misses in a row (last: %s: %s): every lookup is a "
                        "miss and nothing is saved until it answers again (probing in %.1f s)", self.endpoint,
                        self._in_a_row, reason.value, detail, self.settings.open_s)
            if self._prober is None or not self._prober.is_alive():
                self._prober = threading.Thread(target=self._probe_until_closed, name="kvstore-breaker-probe",
                                                daemon=True)
                self._prober.start()

    def _probe_until_closed(self) -> None:
        wait = self.settings.open_s
        while not self._stop.wait(wait):
            self._probes += 1
            try:
                self._probe()
            except Exception as exc:  # noqa: BLE001 - any failure keeps it open
                wait = min(wait * 2, self.settings.open_max_s)
                log.debug("kvstore breaker for %s: probe failed (%s); next in %.1f s", self.endpoint, exc, wait)
                continue
            with self._lock:
                opened, self._open_since, self._in_a_row = self._open_since, None, 0
                self._closed += 1
            log.warning("kvstore breaker for %s CLOSED: it answers again after %.1f s open", self.endpoint,
                        self._clock() - (opened if opened is not None else self._clock()))
            return

    def close(self) -> None:
        """Stop the background probe (the endpoint is being closed)."""
        self._stop.set()
        prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join(1.0)

    def snapshot(self) -> dict[str, object]:
        """``state`` (``closed``/``open``), ``open_for_s``, ``opened``/``closed`` (transitions), ``probes``."""
        with self._lock:
            since = self._open_since
            return {"endpoint": self.endpoint, "state": "closed" if since is None else "open",
                    "open_for_s": 0.0 if since is None else round(self._clock() - since, 3),
                    "opened": self._opened, "closed": self._closed, "probes": self._probes}
