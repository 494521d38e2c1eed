"""The remote tier's stats: the server's memory use and limit from ``INFO memory`` (summed over a cluster's
primaries), its counters, and their Prometheus families."""

from __future__ import annotations

from dataclasses import asdict

from pathlib import Path

from remotelib import remote_tier
from tiers_testlib import LAYOUTS, make_blocks, make_keys

from benchmarks.redis_servers import RedisClusterProcs, start_server
from kvstore.daemon.server.backend_counters import BackendCounters
from kvstore.daemon.server.metrics import DaemonMetrics, render_prometheus
from kvstore.tiers.base import TierStats

L = LAYOUTS["float16"]


def _info_memory(cli_out: str, field: str) -> int:
    return int(next(line.split(":", 1)[1] for line in cli_out.splitlines() if line.startswith(field + ":")))


def test_standalone_capacity_and_usage_come_from_info_memory(tmp_path: Path) -> None:
    server = start_server(tmp_path / "mem", maxmemory="48mb")
    tier = remote_tier(L, server.url, group_blocks=2, key_prefix="mem:", listen_evictions=False)
    try:
        before = tier.stats().used_bytes
        keys = make_keys(L, 16, seed=1)
        assert tier.put(keys, make_blocks(L, 16, seed=1)) == [True] * 16
        st = tier.stats()
        assert st.capacity_bytes == 48 << 20
        assert st.used_bytes - before >= 16 * L.bytes_per_block  # the values are in the server's used_memory
        assert abs(st.used_bytes - _info_memory(server.cli("INFO", "memory"), "used_memory")) < 1 << 20
        server.cli("CONFIG", "SET", "maxmemory", "0")
        assert tier.stats().capacity_bytes == 0  # unbounded: no capacity to report
        server.stop()
        down = tier.stats()
        assert (down.used_bytes, down.capacity_bytes) == (0, 0)  # not answering: no figures, no exception
    finally:
        tier.close()
        server.stop()


def test_cluster_capacity_is_summed_over_the_primaries(redis_cluster: RedisClusterProcs) -> None:
    masters = redis_cluster.masters()
    limits = [32 << 20, 40 << 20, 48 << 20]
    tier = remote_tier(L, redis_cluster.url, group_blocks=1, key_prefix="cmem:", listen_evictions=False)
    try:
        for node, limit in zip(masters, limits):
            node.cli("CONFIG", "SET", "maxmemory", str(limit))
        st = tier.stats()
        assert st.capacity_bytes == sum(limits)
        used = sum(_info_memory(m.cli("INFO", "memory"), "used_memory") for m in masters)
        assert abs(st.used_bytes - used) < 3 << 20
    finally:
        for node in masters:
            node.cli("CONFIG", "SET", "maxmemory", "0")
        tier.close()


def test_remote_counters_and_memory_are_rendered_for_prometheus(tmp_path: Path) -> None:
    server = start_server(tmp_path / "prom", maxmemory="32mb")
    tier = remote_tier(L, server.url, group_blocks=1, key_prefix="prom:", listen_evictions=False)
    try:
        keys = make_keys(L, 3, seed=2)
        tier.put(keys[:2], make_blocks(L, 2, seed=2))
        tier.get(keys, make_blocks(L, 3, seed=0))  # two hits and a miss (inferred as an eviction)
        remote = tier.stats().as_dict()
    finally:
        tier.close()
        server.stop()
    counters = asdict(BackendCounters())  # every counter the daemon renders, at 0
    snapshot = {"counters": counters, "host": TierStats().as_dict(), "remote": remote, "holds": 0,
                "holds_expired": 0, "pending_writes": 0, "write_failures": 0, "not_durable": 0}
    lines = render_prometheus(DaemonMetrics(), snapshot, {"version": "test"}).splitlines()
    for want in ('kvstore_hits_total{tier="remote"} 2', 'kvstore_misses_total{tier="remote"} 1',
                 'kvstore_capacity_bytes{tier="remote"} 33554432', f'kvstore_used_bytes{{tier="remote"}} {remote["used_bytes"]}',
                 'kvstore_remote_evictions_total{source="inferred"} 1', 'kvstore_remote_evictions_total{source="notified"} 0',
                 "kvstore_remote_errors_total 0", "kvstore_remote_probe_timeouts_total 0",
                 "kvstore_remote_groups_stored_total 2"):
        assert want in lines, want
    assert remote["used_bytes"] > 0
