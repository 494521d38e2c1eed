"""Helpers for the remote-tier tests: tiers on a given URL with small timeouts, polling."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvstore.config.remote import RemoteConfig
from kvstore.layout import KVLayout
from kvstore.tiers.redis.tier import RedisTier


def remote_tier(layout: KVLayout, url: str, **over: Any) -> RedisTier:
    """A :class:`RedisTier` on ``url`` with test-sized timeouts and back-off (``over`` sets config fields)."""
    # probe_timeout_s above timeout_s: a probe fails by the reply timeout, as in the tests written before the
    # bound, and a loaded machine never cuts one short (test_remote_probe_bound.py sets its own)
    fields: dict[str, Any] = {"url": url, "timeout_s": 0.5, "connect_timeout_s": 0.3, "reconnect_min_s": 0.02,
                              "reconnect_max_s": 0.2, "probe_timeout_s": 5.0}
    fields.update(over)
    return RedisTier(layout, RemoteConfig(**fields))


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``cond`` every 20 ms until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
