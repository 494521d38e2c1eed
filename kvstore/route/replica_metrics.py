"""A replica's ``/metrics`` (Prometheus text) read as load: kvstore's engine gauges, or vLLM's.

kvstore's engine server reports ``kvstore_engine_in_flight_requests`` and ``kvstore_engine_in_flight_tokens``
(:mod:`engine.server.metrics`). vLLM's in-flight requests are ``vllm:num_requests_running +
vllm:num_requests_waiting`` (summed over label sets: one per engine / data-parallel rank); vLLM 0.33 has no
gauge of tokens in flight, so a vLLM replica reports 0 tokens (the router still counts the tokens it sent
there itself). A body that does not parse, or a sample that is not a finite number, counts as nothing: the
poller never fails on what a replica's metrics say, only on not reaching it.
"""

from __future__ import annotations

import math
import re
from typing import Any

from kvstore.route.policy import ReplicaLoad

VLLM_REQUEST_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
"""vLLM's gauges whose sum is its requests in flight."""

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(\s+-?\d+)?\s*$")


def prometheus_totals(text: str) -> dict[str, float]:
    """Each metric's samples in Prometheus text ``text``, summed over label sets. Comments, malformed lines
    and values that are not finite numbers are skipped. Pure."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            name = match.group(1)
            totals[name] = totals.get(name, 0.0) + value
    return totals


def _count(value: Any) -> int:
    """A non-negative count from a reported value; anything else is 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0
    return max(int(value), 0)


KVSTORE_GAUGES = ("kvstore_engine_in_flight_requests", "kvstore_engine_in_flight_tokens")
"""kvstore's engine server's gauges of requests and tokens in flight."""


def replica_load(body: bytes) -> ReplicaLoad:
    """The load a replica's ``/metrics`` text reports: kvstore's engine gauges when present, else vLLM's."""
    totals = prometheus_totals(body.decode("utf-8", errors="replace"))
    requests, tokens = KVSTORE_GAUGES
    if requests in totals:
        return ReplicaLoad(_count(totals[requests]), _count(totals.get(tokens, 0.0)))
    return ReplicaLoad(sum(_count(totals.get(name, 0.0)) for name in VLLM_REQUEST_GAUGES), 0)
