"""RateLimitedLog: one line per topic per interval, with the count of what was suppressed."""

from __future__ import annotations

import logging

import pytest

from kvstore.util.ratelog import RateLimitedLog


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_repeats_within_interval_are_suppressed_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    limiter = RateLimitedLog(logging.getLogger("kvstore.test.ratelog"), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvstore.test.ratelog"):
        assert limiter.warning("disk", "disk full: %d blocks", 1) is True
        assert [limiter.warning("disk", "disk full: %d blocks", i) for i in range(5)] == [False] * 5
        assert limiter.suppressed("disk") == 5
        assert limiter.warning("other", "another topic") is True  # topics are independent
        clock.t += 10.0
        assert limiter.warning("disk", "disk full: %d blocks", 7) is True
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "disk full: 1 blocks",
        "another topic",
        "disk full: 7 blocks (5 similar messages suppressed in the last 10 s)",
    ]
    assert limiter.suppressed("disk") == 0


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        RateLimitedLog(logging.getLogger("x"), interval_s=0)
