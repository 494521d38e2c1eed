"""Load or recompute, by cost: a cached prefix is loaded only when it is expected to arrive before the engine
could compute it.

Inputs, measured as the store runs: the tier's load bandwidth and per-load
latency (:class:`~kvstore.store.load_clock.LoadClock`) and the engine's prefill
rate in tokens per second (:meth:`LoadCost.record_prefill`). For a match of
``n`` blocks::

    load     = latency + n * bytes_per_block / bandwidth
    compute  = n * block_size / prefill_rate
    decision = recompute if load > MARGIN * compute else load

On a CPU almost every prefix is loaded (prefill is slow); on a fast GPU a
short prefix behind a slow network tier is recomputed. Until the prefill
rate has been measured, and with ``deadlines.always_load``, everything is
loaded. A tier judged too slow is still tried once every
:data:`REMEASURE_EVERY` decisions, so a recovered tier is noticed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvstore.store.load_clock import LoadClock

WEIGHT = 0.2
"""Weight of the newest prefill measurement in the measured rate."""
MIN_PREFILL_TOKENS = 64
"""Steps computing fewer tokens do not measure the prefill rate (their time is the step's overhead)."""
MARGIN = 2.0
"""A match is recomputed only when loading it is expected to take more than this many times as long: the
measurements are noisy (a step's time includes the scheduler's; a load's the round trip), and a load also
spares the engine the compute, for other requests."""
REMEASURE_EVERY = 16
"""Every this many "recompute" decisions, one match is loaded anyway, to measure the tier again."""


@dataclass(frozen=True)
class LoadDecision:
    """One decision and its inputs (what ``/metrics`` shows of it)."""

    load: bool
    blocks: int
    expected_load_s: float
    expected_compute_s: float | None
    """``None``: the prefill rate is not measured yet (then everything is loaded)."""

    @property
    def worth_s(self) -> float | None:
        """How long the load is worth waiting for: ``MARGIN`` times the expected compute (past it recomputing
        would have been the better choice, so a load still running then is given up); ``None``: not known."""
        return None if self.expected_compute_s is None else MARGIN * self.expected_compute_s


class LoadCost:
    """Decides, per matched prefix, whether loading it beats recomputing it (see the module docstring)."""

    def __init__(self, clock: LoadClock, always_load: bool = False) -> None:
        self.clock = clock
        self.always_load = always_load
        self.prefill_rate: float | None = None
        """Tokens per second the engine computes a prompt at, measured (``None`` until a step is measured)."""
        self.decisions = {"load": 0, "recompute": 0}
        """How many matches were loaded and how many recomputed."""
        self._since_load = 0
        self._lock = threading.Lock()

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` prompt tokens in ``seconds`` (one step)."""
        if tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds
        with self._lock:
            self.prefill_rate = rate if self.prefill_rate is None else (1 - WEIGHT) * self.prefill_rate + WEIGHT * rate

    def decide(self, blocks: int, block_size: int, bytes_per_block: int) -> LoadDecision:
        """Whether to load a match of ``blocks`` blocks (counted in :attr:`decisions`)."""
        load_s = self.clock.latency + blocks * bytes_per_block / self.clock.bandwidth
        rate = self.prefill_rate
        compute_s = None if rate is None else blocks * block_size / rate
        with self._lock:
            load = self.always_load or compute_s is None or load_s <= MARGIN * compute_s
            if not load:
                self._since_load += 1
                if self._since_load >= REMEASURE_EVERY:
                    load = True  # measure the tier again: it may have recovered
            if load:
                self._since_load = 0
            self.decisions["load" if load else "recompute"] += 1
        return LoadDecision(load, blocks, load_s, compute_s)

    def snapshot(self) -> dict[str, object]:
        """The decisions so far and their inputs now."""
        return {"decisions": dict(self.decisions), "load_bandwidth_bytes_per_s": round(self.clock.bandwidth),
                "load_latency_s": round(self.clock.latency, 6), "prefill_tokens_per_s":
                    None if self.prefill_rate is None else round(self.prefill_rate, 1), "always_load": self.always_load}
