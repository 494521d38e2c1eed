"""A replica's ``/metrics`` read as load: kvstore's JSON, or vLLM's Prometheus text.

kvstore's engine server answers ``{"in_flight_requests": N, "in_flight_tokens": T}``. vLLM answers
Prometheus text; its in-flight requests are ``vllm:num_requests_running + vllm:num_requests_waiting``
(summed over label sets: one per engine / data-parallel rank). vLLM 0.33 has no gauge of tokens in
flight, so a vLLM replica reports 0 tokens (the router still counts the tokens it sent there itself).
A body that does not parse, or a sample that is not a finite number, counts as nothing: the poller
never fails on what a replica's metrics say, only on not reaching it.
"""

from __future__ import annotations

import json
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


def vllm_load(text: str) -> ReplicaLoad:
    """The load vLLM's Prometheus ``/metrics`` text reports (tokens: 0, vLLM has no such gauge)."""
    totals = prometheus_totals(text)
    return ReplicaLoad(sum(_count(totals.get(name, 0.0)) for name in VLLM_REQUEST_GAUGES), 0)


def kvstore_load(body: bytes) -> ReplicaLoad:
    """The load kvstore's JSON ``/metrics`` body reports (a field that is missing or not a number: 0)."""
    try:
        fields = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ReplicaLoad(0, 0)
    if not isinstance(fields, dict):
        return ReplicaLoad(0, 0)
    return ReplicaLoad(_count(fields.get("in_flight_requests")), _count(fields.get("in_flight_tokens")))


def replica_load(content_type: str, body: bytes) -> ReplicaLoad:
    """The load a ``/metrics`` answer reports: JSON (kvstore) by its content type, else Prometheus text (vLLM)."""
    if content_type == "application/json":
        return kvstore_load(body)
    return vllm_load(body.decode("utf-8", errors="replace"))
