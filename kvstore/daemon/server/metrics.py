"""Daemon metrics: request counters and latency histograms, rendered in the Prometheus text format.

Only the event loop thread updates these (no lock). Tier figures (hits,
misses, bytes, evictions, occupancy, corrupt entries dropped) are not copied
here: :func:`render_prometheus` reads them from the backend's stats snapshot
at scrape time, so there is one source of truth per number.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.util.prometheus import Family, Kind, number, render

LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)
"""Upper bounds (seconds) of the request latency histogram buckets."""


@dataclass
class Histogram:
    """Cumulative-on-render histogram: per-bucket counts, total count and sum."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: int = 0
    sum: float = 0.0

    def observe(self, value: float) -> None:
        """Add one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += 1
        self.sum += value


@dataclass
class DaemonMetrics:
    """Counters the server updates per request and per connection."""

    requests: dict[str, int] = field(default_factory=dict)
    latency: dict[str, Histogram] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    """Error replies sent, by error code name."""
    bytes_in: int = 0
    """Frame bytes received (headers included)."""
    bytes_out: int = 0
    """Frame bytes sent."""
    clients: int = 0
    """Connections open now (handshaken or not)."""
    connections: int = 0
    """Connections accepted since start."""

    def observe(self, op: str, seconds: float) -> None:
        """Count one served request of ``op`` and its latency."""
        self.requests[op] = self.requests.get(op, 0) + 1
        self.latency.setdefault(op, Histogram()).observe(seconds)

    def error(self, code: str) -> None:
        """Count one error reply."""
        self.errors[code] = self.errors.get(code, 0) + 1


def render_prometheus(m: DaemonMetrics, backend: dict[str, Any] | list[tuple[dict[str, str], dict[str, Any]]],
                      build: dict[str, str]) -> str:
    """The ``/metrics`` body for the metrics ``m``, the storage snapshots and the
    :func:`~kvstore.build_info.build_info` of this process.

    ``backend``: one :meth:`DaemonBackend.stats` snapshot, or one per layout with the labels that tell them
    apart (``{"layout": ...}``), each storage sample then carrying its layout's labels.
    """
    snapshots = [({}, backend)] if isinstance(backend, dict) else backend
    families: dict[str, Family] = {}

    def family(name: str, kind: Kind, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        if name in families:
            families[name].samples.extend(samples)
        else:
            families[name] = Family(name, kind, help_text, list(samples))

    for extra, snapshot in snapshots:
        _storage_families(family, snapshot, extra)
    family("kvstore_build_info", "gauge", "Always 1; the labels say which build is running.",
           [(dict(build), 1)])
    family("kvstore_protocol_bytes_in_total", "counter", "Protocol bytes received.", [({}, m.bytes_in)])
    family("kvstore_protocol_bytes_out_total", "counter", "Protocol bytes sent.", [({}, m.bytes_out)])
    family("kvstore_connected_clients", "gauge", "Client connections open now.", [({}, m.clients)])
    family("kvstore_connections_total", "counter", "Client connections accepted.", [({}, m.connections)])
    family("kvstore_requests_total", "counter", "Requests served, by operation.",
           [({"op": op}, n) for op, n in sorted(m.requests.items())])
    family("kvstore_errors_total", "counter", "Error replies sent, by error code.",
           [({"code": code}, n) for code, n in sorted(m.errors.items())])
    lines = ["# HELP kvstore_request_seconds Request latency in the daemon, by operation.",
             "# TYPE kvstore_request_seconds histogram"]
    for op, h in sorted(m.latency.items()):
        running = 0
        for bound, count in zip(list(h.bounds) + [float("inf")], h.counts):
            running += count
            lines.append(f'kvstore_request_seconds_bucket{{op="{op}",le="{number(bound)}"}} {running}')
        lines.append(f'kvstore_request_seconds_sum{{op="{op}"}} {number(h.sum)}')
        lines.append(f'kvstore_request_seconds_count{{op="{op}"}} {h.total}')
    return render(list(families.values()), "\n".join(lines) + "\n")


def _storage_families(family: Callable[[str, Kind, str, list[tuple[dict[str, str], float]]], None],
                      backend: dict[str, Any], extra: dict[str, str]) -> None:
    """The families read from one layout's storage snapshot, each sample's labels joined with ``extra``."""

    def add(name: str, kind: Kind, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        family(name, kind, help_text, [({**labels, **extra}, value) for labels, value in samples])

    tiers = [(t, backend[t]) for t in ("host", "disk", "remote") if backend.get(t) is not None]
    c = backend["counters"]
    add("kvstore_hits_total", "counter", "Blocks found, by the tier that served them.",
           [({"tier": "host"}, c["host_hits"])] + ([({"tier": "disk"}, c["disk_hits"])] if backend.get("disk") else [])
           + ([({"tier": "remote"}, backend["remote"]["hits"])] if backend.get("remote") else []))
    add("kvstore_misses_total", "counter", "Blocks asked for and not found in the tier.",
           [({"tier": "host"}, c["host_misses"])] + ([({"tier": "disk"}, c["disk_misses"])] if backend.get("disk") else [])
           + ([({"tier": "remote"}, backend["remote"]["misses"])] if backend.get("remote") else []))
    add("kvstore_prefix_cache_queries_total", "counter",
           "Prompt tokens looked up in the daemon's tiers, as vLLM's prefix_cache_queries counts them. The daemon "
           "sees block keys, not tokens: counted as blocks probed (EXISTS_PREFIX) x block size, and an engine "
           "asks only for blocks beyond its own GPU cache.", [({}, c["prefix_query_tokens"])])
    add("kvstore_prefix_cache_hits_total", "counter",
           "Of kvstore_prefix_cache_queries_total, the tokens found cached (leading blocks held in host or disk, "
           "x block size), as vLLM's prefix_cache_hits.", [({}, c["prefix_hit_tokens"])])
    by_tier = c.get("prefix_hit_tokens_by_tier", {})
    add("kvstore_prefix_hit_tokens_total", "counter",
           "kvstore_prefix_cache_hits_total by the daemon tier holding each block (host, disk, remote): how much of "
           "the cached prefixes came out of RAM.", [({"tier": t}, by_tier.get(t, 0)) for t, _ in tiers])
    add("kvstore_block_bytes_out_total", "counter", "Block bytes served to clients (shared memory or inline).",
           [({}, c["bytes_out"])])
    add("kvstore_block_bytes_in_total", "counter", "Block bytes stored by clients.", [({}, c["bytes_in"])])
    add("kvstore_tier_bytes_read_total", "counter", "Raw block bytes read out of the tier.",
           [({"tier": t}, s["bytes_read"]) for t, s in tiers])
    add("kvstore_tier_bytes_written_total", "counter", "Raw block bytes stored into the tier.",
           [({"tier": t}, s["bytes_written"]) for t, s in tiers])
    add("kvstore_evictions_total", "counter", "Blocks evicted to respect the tier's capacity.",
           [({"tier": t}, s["evictions"]) for t, s in tiers])
    add("kvstore_corrupt_dropped_total", "counter", "Stored entries that failed verification and were deleted.",
           [({"tier": t}, s["corrupt_dropped"]) for t, s in tiers])
    add("kvstore_used_bytes", "gauge", "Bytes occupied in the tier.", [({"tier": t}, s["used_bytes"]) for t, s in tiers])
    add("kvstore_capacity_bytes", "gauge", "Capacity of the tier in bytes.",
           [({"tier": t}, s["capacity_bytes"]) for t, s in tiers])
    add("kvstore_blocks", "gauge", "Blocks stored in the tier.", [({"tier": t}, s["num_blocks"]) for t, s in tiers])
    remote = backend.get("remote")
    if remote is not None:
        add("kvstore_remote_errors_total", "counter", "Remote-tier round trips (or commands in one) that failed: "
               "refused or lost connection, timeout, cluster down; each was answered as a miss.",
               [({}, remote["errors"])])
        add("kvstore_remote_probe_timeouts_total", "counter", "Remote prefix probes not answered within "
               "remote.probe_timeout_s (answered as misses).", [({}, remote["probe_timeouts"])])
        add("kvstore_remote_skipped_total", "counter", "Remote accesses answered as misses without a round trip "
               "while the tier backed off after failures.", [({}, remote["skipped"])])
        add("kvstore_remote_reconnects_total", "counter", "Times the remote server answered again after failures.",
               [({}, remote["reconnects"])])
        add("kvstore_remote_evictions_total", "counter", "Remote blocks Redis evicted, by how the tier learnt of it "
               "(keyspace notification, or a read that found no value).",
               [({"source": "notified"}, remote["evictions_notified"]),
                ({"source": "inferred"}, remote["evictions_inferred"])])
        add("kvstore_remote_groups_stored_total", "counter", "Remote values (groups of blocks) newly stored.",
               [({}, remote["groups_stored"])])
    add("kvstore_no_room_total", "counter", "Keys not served because every host slot was locked or reserved.",
           [({}, c["no_room"])])
    add("kvstore_written_through_total", "counter", "Blocks of inline puts written straight to disk because every "
           "host slot was locked or reserved (a full host tier slows a put, it does not refuse it).",
           [({}, c["written_through"])])
    add("kvstore_reserve_share_refused_total", "counter",
           "Keys a reserve answered BUSY because the connection already held half of the host slots the other "
           "connections leave (reserved or quarantined), or had quarantined slots it did not release.",
           [({}, c["share_refused"])])
    add("kvstore_holds", "gauge", "Host slot holds held by clients now.", [({}, backend["holds"])])
    add("kvstore_holds_expired_total", "counter", "Holds ended by their deadline (vanished or slow clients).",
           [({}, backend["holds_expired"])])
    add("kvstore_pending_writes", "gauge", "Committed blocks not yet written to disk.", [({}, backend["pending_writes"])])
    add("kvstore_dirty_blocks", "gauge", "Committed blocks held in host and not yet on disk under policy.write: "
           "write_back (or write_through_selective before their hits): written back when host clean room runs low, "
           "at FLUSH and at a graceful stop; lost by a kill -9.", [({}, backend.get("dirty_blocks", 0))])
    add("kvstore_cleaned_ahead_total", "counter", "Dirty blocks written back ahead of need because the host tier's "
           "clean room (free or evictable slots) fell below its low-water mark.",
           [({}, backend.get("cleaned_ahead", 0))])
    add("kvstore_write_failures_total", "counter", "Blocks the write-behind failed to write to disk (full or failing disk).",
           [({}, backend["write_failures"])])
    add("kvstore_not_durable_total", "counter", "Acknowledged blocks whose disk write failed (lost at restart).",
           [({}, backend["not_durable"])])
    add("kvstore_flush_failures_total", "counter", "Flushes that reported acknowledged blocks not durable.",
           [({}, c["flush_failures"])])
    add("kvstore_hold_owner_releases_total", "counter",
           "Holds ended at once because the client process holding them exited.", [({}, c["owner_releases"])])
