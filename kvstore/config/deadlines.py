"""The ``deadlines:`` section: how long an engine ever waits on kvstore, and when it stops asking.

The promise is that the cache can make a request faster, never slower and
never stuck: a daemon that is paused, swapping or stuck on its disk costs
an engine at most these deadlines, and after ``breaker_failures`` misses in
a row nothing at all until it answers again (:mod:`kvstore.util.breaker`).
"""

from __future__ import annotations

from pydantic import Field

from kvstore.util.breaker import BreakerSettings
from kvstore.config.section import Section
from kvstore.config.units import PositiveSize


class DeadlinesConfig(Section):
    """Deadlines of every call an engine makes into a ``kvstore serve`` daemon, and its circuit breaker."""

    lookup_ms: float = Field(50.0, gt=0, le=600_000)
    """A lookup (which blocks of a prompt are stored) not answered within this counts as a miss: the engine
    computes the prompt. It runs in vLLM's scheduler loop, so it bounds what a stalled daemon adds to a step."""
    load_floor_ms: float = Field(500.0, gt=0, le=600_000)
    """Least time a load gets. A load's deadline is this plus ``load_slack`` times its bytes over the
    bandwidth measured on earlier loads (``load_bandwidth`` before the first); a load past it fails and the
    engine recomputes those blocks. Bytes that arrive late are never used."""
    load_slack: float = Field(4.0, ge=1, le=1000)
    """How many times the expected transfer time a load may take before it counts as missed."""
    load_bandwidth: PositiveSize = "1GiB"  # type: ignore[assignment]
    """Bytes per second a load's deadline assumes before any load has been measured."""
    save_ms: float = Field(2000.0, gt=0, le=600_000)
    """A save (blocks handed to the daemon, from a background thread, never the engine's step) gives up after
    this; its blocks are not stored (a later miss, counted as ``deadline``)."""
    save_queue: PositiveSize = "256MiB"  # type: ignore[assignment]
    """Most bytes of saves waiting for the background writer; a save that does not fit is dropped and counted
    (``queue_full``), so a slow daemon never holds the engine's step or grows its memory."""
    breaker_failures: int = Field(3, ge=1, le=1_000_000)
    """Misses in a row (deadlines passed, connection errors) that open the breaker: then every lookup is a
    fast miss and nothing is sent until a background probe finds the daemon answering."""
    breaker_open_s: float = Field(1.0, gt=0, le=3600)
    """First wait before probing an open breaker's daemon (doubling after each failed probe)."""
    breaker_open_max_s: float = Field(5.0, gt=0, le=86_400)
    """Longest wait between two probes of an open breaker (so the cache is back within this of the daemon's
    return, whatever the length of its pause)."""
    probe_ms: float = Field(1000.0, gt=0, le=600_000)
    """Deadline of the breaker's probe (reconnect, login, one empty lookup)."""
    always_load: bool = False
    """Load every cached prefix found. ``false`` (the default): vLLM's full connector loads a prefix only when it
    is expected to arrive before vLLM could compute it (the load bandwidth and latency its workers measure
    against the prefill rate its scheduler measures, :mod:`kvstore.store.load_cost`); a prefix behind a tier slower
    than the engine is recomputed."""

    def breaker(self) -> BreakerSettings:
        """The breaker's settings."""
        return BreakerSettings(self.breaker_failures, self.breaker_open_s, max(self.breaker_open_s,
                                                                                self.breaker_open_max_s))
