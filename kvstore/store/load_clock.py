"""How long a load may take: its bytes at the bandwidth measured on earlier loads, with a floor.

A load that misses its deadline is given up and the engine recomputes what
did not come (late bytes are never used), so a slow or stalled tier costs a
request at most this long, never the stall. The bandwidth is measured as the
store runs (an exponential average of the loads large enough to measure
bytes rather than round trips), starting from ``deadlines.load_bandwidth``.
"""

from __future__ import annotations

import threading

from kvstore.config.deadlines import DeadlinesConfig

WEIGHT = 0.2
"""Weight of the newest load in the measured bandwidth."""
MEASURED_BYTES = 1 << 20
"""Loads smaller than this do not update the measured bandwidth (their time is the round trip's, not the bytes')."""


MISSED_FACTOR = 2.0
"""A load given up after ``t`` seconds is assumed to need at least this many times ``t``: strictly slower than
what missed, by as much as the load decision's own margin (:data:`kvstore.store.load_cost.MARGIN`), so a prefill rate
measured up to that much slower does not flip the decision back to loading."""


class LoadClock:
    """The deadline of a load of ``n`` bytes from one tier (or one daemon), from what earlier loads measured."""

    def __init__(self, deadlines: DeadlinesConfig) -> None:
        self.deadlines = deadlines
        self.bandwidth = float(deadlines.load_bandwidth)
        """Bytes per second, measured (``deadlines.load_bandwidth`` until the first measured load)."""
        self.measured = 0
        """Loads measured so far."""
        self.latency = 0.0
        """Seconds a load takes whatever its size (an exponential average of the loads too small to measure the
        bandwidth: their time is a round trip's)."""
        self._lock = threading.Lock()

    def deadline_s(self, nbytes: int) -> float:
        """Seconds a load of ``nbytes`` may take: ``load_floor_ms`` plus ``load_slack`` times its expected time."""
        d = self.deadlines
        return d.load_floor_ms / 1000 + d.load_slack * nbytes / self.bandwidth

    def adopt(self, bandwidth: float, latency: float) -> None:
        """Take another process's measurement (vLLM's scheduler decides from what its workers measured)."""
        if bandwidth > 0:
            with self._lock:
                self.bandwidth, self.latency = bandwidth, max(0.0, latency)
                self.measured += 1

    def record_missed(self, nbytes: int, seconds: float) -> None:
        """A load of ``nbytes`` was given up at its deadline after ``seconds``: the tier is slower than that
        now, whatever the average said (a stalled tier is believed at once, not averaged in). Its bytes did not
        come in ``seconds``, so they are assumed to need at least twice that (:data:`MISSED_FACTOR`), and each
        further miss halves the estimate again. Believing only ``nbytes / seconds`` would leave the estimate at
        the very deadline that missed: a load given up at its worth (``MARGIN`` times the compute) would
        measure the tier at exactly that worth, and the next decision would be a coin toss between loading
        and recomputing that any noise in the prefill rate flips, for ever (a real vLLM loaded, recomputed
        and loaded again from a stalled tier: ``tests/vllm_engine/test_slow_tier.py``)."""
        if seconds <= 0 or nbytes <= 0:
            return
        with self._lock:
            self.bandwidth = min(self.bandwidth / 2, nbytes / (MISSED_FACTOR * seconds))
            self.measured += 1

    def record(self, nbytes: int, seconds: float) -> None:
        """A load of ``nbytes`` took ``seconds``."""
        if seconds <= 0:
            return
        if nbytes < MEASURED_BYTES:
            with self._lock:
                self.latency = seconds if self.latency == 0 else (1 - WEIGHT) * self.latency + WEIGHT * seconds
            return
        rate = nbytes / seconds
        with self._lock:
            self.bandwidth = rate if self.measured == 0 else (1 - WEIGHT) * self.bandwidth + WEIGHT * rate
            self.measured += 1
