"""A live daemon (subprocess): shared-memory and inline data paths, holds, stats, metrics, socket mode."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from daemonlib import (
    LAYOUT, REPO, Daemon, block_for, cleanup, empty_blocks, keys_for, short_tmpdir, start_daemon, write_config,
)
from kvstore.daemon.wire import messages as m
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.wire.frames import DaemonError, ErrorCode, Op
from kvstore.hashing import block_keys


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root, daemon={"hold_timeout_s": 1.0}))
        yield d
    finally:
        cleanup(d, root)


def test_socket_file_is_private(daemon: Daemon) -> None:
    mode = os.stat(daemon.socket_path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_shared_memory_round_trip_and_prefix(daemon: Daemon) -> None:
    tier = daemon.tier(client_name="shm")
    assert tier.client.arena is not None  # local client: the data plane is shared memory
    keys = keys_for(12, seed=1)
    assert tier.put(keys[:8], [block_for(k) for k in keys[:8]]) == [True] * 8
    assert tier.put(keys[:2], [block_for(k) for k in keys[:2]]) == [True, True]  # content-addressed: no-op
    assert tier.contains_prefix(keys) == 8
    dests = empty_blocks(12)
    assert tier.get(keys, dests) == [True] * 8 + [False] * 4
    for k, d in zip(keys[:8], dests[:8]):
        assert torch.equal(d, block_for(k))
    assert tier.client.stats()["holds"] == 0  # every GET_SHM hold was released
    tier.close()


def test_inline_client_sees_shm_client_blocks(daemon: Daemon) -> None:
    writer = daemon.tier(client_name="writer")
    reader = daemon.tier(client_name="inline", use_shm=False)
    assert reader.client.arena is None
    keys = keys_for(5, seed=2)
    assert reader.put(keys[3:], [block_for(k) for k in keys[3:]]) == [True, True]
    assert writer.put(keys[:3], [block_for(k) for k in keys[:3]]) == [True] * 3
    dests = empty_blocks(5)
    assert reader.get(keys, dests) == [True] * 5
    assert all(torch.equal(d, block_for(k)) for k, d in zip(keys, dests))
    assert writer.contains_prefix(keys) == 5
    writer.close()
    reader.close()


def test_blocks_evicted_from_host_come_back_from_disk(daemon: Daemon) -> None:
    tier = daemon.tier(client_name="evict")
    keys = keys_for(100, seed=3)  # 64 host slots: the first ones leave the host tier
    assert all(tier.put(keys, [block_for(k) for k in keys]))
    tier.flush()
    before = tier.client.stats()
    assert before["host"]["evictions"] > 0
    dests = empty_blocks(10)
    assert tier.get(keys[:10], dests) == [True] * 10
    assert all(torch.equal(d, block_for(k)) for k, d in zip(keys[:10], dests))
    after = tier.client.stats()
    assert after["counters"]["disk_hits"] - before["counters"]["disk_hits"] == 10
    tier.close()


def test_tenant_salt_comes_from_the_daemon() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root, daemon={"tenant_salts": {"tok-a": "tenant-a"}}))
        tier = d.tier(client_name="tenant", token="tok-a")
        assert tier.salt == b"tenant-a"
        plain = d.tier(client_name="plain")
        assert plain.salt is None
        tokens = list(range(8))
        assert block_keys(tokens, LAYOUT, tier.salt) != block_keys(tokens, LAYOUT, plain.salt)
        tier.close()
        plain.close()
        with pytest.raises(DaemonError, match="UNAUTHORIZED"):
            DaemonClient(LAYOUT, socket_path=d.socket_path, token="not-a-token").connect()
    finally:
        cleanup(d, root)


def test_wrong_layout_is_refused(daemon: Daemon) -> None:
    other = LAYOUT.__class__(**{**LAYOUT.__dict__, "model_id": "another-model"})
    with pytest.raises(DaemonError, match=r"model id: engine 'another-model', daemon 'daemon-test' \(model.model_id\)"):
        DaemonClient(other, socket_path=daemon.socket_path).connect()


def test_holds_of_a_vanished_client_are_released(daemon: Daemon) -> None:
    """A connection that closes with holds open: its read holds end at once (it copies nothing more), its
    reserved slots are quarantined, not reused (its process may be paused inside a copy), none waits for
    its deadline."""
    tier = daemon.tier(client_name="lessee")
    keys = keys_for(4, seed=4)
    tier.put(keys, [block_for(k) for k in keys])
    c = tier.client
    slots = m.decode_slots(c.keys_request(Op.GET_SHM, keys), Op.GET_SHM)
    reserved = m.decode_slots(c.keys_request(Op.PUT_SHM_RESERVE, keys_for(2, seed=5)), Op.PUT_SHM_RESERVE)
    assert all(s is not None for _, s in slots) and [st for st, _ in reserved] == [m.PutState.RESERVED] * 2
    before = c.stats()
    assert before["holds"] == 6
    c.close()  # vanish without RELEASE or COMMIT
    watcher = DaemonClient(None, socket_path=daemon.socket_path, use_shm=False)
    deadline = time.monotonic() + 1.0  # half the hold timeout: the close ends them, not the deadline
    while (s := watcher.stats())["holds"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s["holds"] == 0 and s["holds_expired"] == before["holds_expired"]
    assert s["counters"]["connection_releases"] - before["counters"]["connection_releases"] == 4
    assert s["counters"]["quarantined"] - before["counters"]["quarantined"] == 2
    watcher.close()


def test_observer_may_only_read_stats(daemon: Daemon) -> None:
    c = DaemonClient(None, socket_path=daemon.socket_path, use_shm=False)
    assert c.stats()["daemon"]["model_id"] == "daemon-test"
    with pytest.raises(DaemonError, match="observer") as exc:
        c.exists_prefix(keys_for(1))
    assert exc.value.code == ErrorCode.NOT_ALLOWED
    c.close()


def test_stats_command(daemon: Daemon) -> None:
    run = [sys.executable, "-m", "kvstore", "stats", "--config", str(daemon.config)]
    out = subprocess.run(run, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "hit rate" in out.stdout and "host" in out.stdout and daemon.socket_path in out.stdout
    assert re.search(r"^prefix cache: \d+ of \d+ tokens looked up were cached( \(\d+\.\d%\))? "
                     r"\(blocks x block size; as vLLM counts\)$", out.stdout, re.M), out.stdout
    assert " 32KiB " in out.stdout  # the host capacity, 64 blocks of 512 bytes
    raw = subprocess.run(run + ["--json"], capture_output=True, text=True, cwd=REPO, timeout=60)
    data = json.loads(raw.stdout)
    assert data["host"]["capacity_bytes"] == 64 * LAYOUT.bytes_per_block and data["daemon"]["clients"] >= 1


def test_healthz_and_metrics(daemon: Daemon) -> None:
    assert daemon.metrics_url is not None
    with urllib.request.urlopen(f"{daemon.metrics_url}/healthz", timeout=10) as r:
        assert r.status == 200 and r.read() == b"ok\n"
    with urllib.request.urlopen(f"{daemon.metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    for name in ("kvstore_hits_total{tier=\"host\"}", "kvstore_misses_total{tier=\"disk\"}", "kvstore_evictions_total",
                 "kvstore_used_bytes{tier=\"host\"}", "kvstore_corrupt_dropped_total", "kvstore_connected_clients",
                 "kvstore_protocol_bytes_in_total", "kvstore_block_bytes_out_total", 'kvstore_request_seconds_bucket{op="GET_SHM",le="+Inf"}'):
        assert name in text, name
    with pytest.raises(urllib.error.HTTPError) as nf:
        urllib.request.urlopen(f"{daemon.metrics_url}/nope", timeout=10)
    assert nf.value.code == 404


def test_serve_help_documents_every_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 0
    for flag in ("--config", "--socket", "--metrics-port", "--log-level", "SIGTERM"):
        assert flag in out.stdout


def _scrape(daemon: Daemon) -> dict[str, str]:
    """``/metrics`` as {sample name with labels: value}."""
    with urllib.request.urlopen(f"{daemon.metrics_url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return dict(line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))


def test_prefix_cache_metrics_count_tokens_as_vllm_does(daemon: Daemon) -> None:
    tier = daemon.tier()
    keys = keys_for(100, seed=49)
    assert tier.put(keys[:49], [block_for(k) for k in keys[:49]]) == [True] * 49
    before = _scrape(daemon)
    # What an engine does for a prompt of 100 blocks whose first 49 are cached: probe it all, load the 49.
    assert tier.contains_prefix(keys) == 49
    assert tier.get(keys[:49], empty_blocks(49)) == [True] * 49
    tier.client.stats()  # reads through the slot directory are reported ahead of the next request: now
    after = _scrape(daemon)
    tier.client.close()

    def delta(name: str) -> int:
        return int(float(after[name])) - int(float(before.get(name, "0")))

    queries, hits = delta("kvstore_prefix_cache_queries_total"), delta("kvstore_prefix_cache_hits_total")
    assert (queries, hits) == (100 * LAYOUT.block_size, 49 * LAYOUT.block_size)  # tokens: 49 %, not 100 %
    assert delta('kvstore_hits_total{tier="host"}') + delta('kvstore_hits_total{tier="disk"}') == 49
    assert delta('kvstore_misses_total{tier="host"}') == 0  # why the block hit counters cannot give the hit rate
    observer = DaemonClient(None, socket_path=daemon.socket_path, use_shm=False)
    counters = observer.stats()["counters"]  # `kvstore stats` reads the same counters
    observer.close()
    assert counters["prefix_query_tokens"] == int(float(after["kvstore_prefix_cache_queries_total"]))
    assert counters["prefix_hit_tokens"] == int(float(after["kvstore_prefix_cache_hits_total"]))


def test_build_info_metric_names_the_running_build(daemon: Daemon) -> None:
    import platform

    from kvstore.build_info import installed_version

    info = [name for name, value in _scrape(daemon).items() if name.startswith("kvstore_build_info{") and value == "1"]
    assert info == [f'kvstore_build_info{{python="{platform.python_version()}",torch="{torch.__version__}",'
                    f'version="{installed_version()}"}}']
