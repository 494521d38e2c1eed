"""The circuit breaker: opens after N misses in a row, a success resets the count, a background probe closes it."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kvstore.util.breaker import BreakerSettings, CircuitBreaker, MissReason


def wait_for(cond, timeout: float = 5.0) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout
        time.sleep(0.01)


def test_it_opens_after_n_misses_in_a_row_and_a_success_resets_the_count(caplog: pytest.LogCaptureFixture) -> None:
    b = CircuitBreaker("unix:/x", BreakerSettings(failures=3, open_s=60), probe=lambda: None)
    b.failed(MissReason.DEADLINE, "slow")
    b.failed(MissReason.DEADLINE, "slow")
    b.succeeded()
    b.failed(MissReason.GONE, "gone")
    b.failed(MissReason.GONE, "gone")
    assert b.allow() and not b.is_open
    with caplog.at_level(logging.WARNING, logger="kvstore.util.breaker"):
        b.failed(MissReason.DEADLINE, "slow again")
    assert b.is_open and not b.allow()
    assert b.snapshot()["state"] == "open" and b.snapshot()["opened"] == 1
    assert [r.getMessage() for r in caplog.records if "OPEN" in r.getMessage()][0].count("deadline: slow again") == 1
    b.failed(MissReason.DEADLINE, "more")  # while open: no second transition, no second line
    assert b.snapshot()["opened"] == 1 and sum("OPEN" in r.getMessage() for r in caplog.records) == 1
    b.close()


def test_a_background_probe_closes_it_once_the_endpoint_answers_backing_off_meanwhile() -> None:
    answering = threading.Event()
    calls: list[float] = []

    def probe() -> None:
        calls.append(time.monotonic())
        if not answering.is_set():
            raise OSError("no answer")

    b = CircuitBreaker("unix:/x", BreakerSettings(failures=1, open_s=0.05, open_max_s=0.2), probe=probe)
    b.failed(MissReason.DEADLINE, "paused")
    wait_for(lambda: len(calls) >= 4)
    assert b.is_open
    gaps = [b2 - a for a, b2 in zip(calls, calls[1:])]
    assert gaps[-1] >= gaps[0] and max(gaps) < 0.5  # the wait doubles, up to open_max_s
    answering.set()
    wait_for(lambda: not b.is_open)
    snap = b.snapshot()
    assert snap["state"] == "closed" and snap["closed"] == 1 and snap["probes"] >= 5
    b.failed(MissReason.DEADLINE, "again")  # it can open again
    assert b.is_open and b.snapshot()["opened"] == 2
    b.close()
