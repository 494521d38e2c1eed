"""``kvstore serve`` with a remote tier: two daemons (two data directories and sockets, standing for two
hosts) share one Redis, or one Redis Cluster. A prefix stored through one is loaded through the other,
bit for bit, and an engine decoding from it equals recompute; tenants keep their namespace on the server;
a dead or paused server never stalls or errors a client of the daemon (its probes and loads are counted
misses); the daemon's ``/metrics`` and STATS show the remote tier."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent.parent / "daemon"))

from daemonlib import (  # noqa: E402
    LAYOUT,
    REPO,
    Daemon,
    block_for,
    cleanup,
    empty_blocks,
    free_port,
    keys_for,
    short_tmpdir,
    start_daemon,
    write_config,
)
from benchmarks.redis_servers import RedisClusterProcs, RedisServer, start_server  # noqa: E402
from kvstore.daemon.client.connection import DaemonClient  # noqa: E402
from kvstore.daemon.client.tier import DaemonTier  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402

G = 4
CONNECTOR_TESTS = REPO / "tests" / "connector"
ENGINE_MODEL = {"model_id": "builtin-random-seed0", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
                "block_size": 4, "dtype": "float32"}
"""The built-in engine's tiny random model (as connlib.engine_config() builds it)."""
TOKEN = "admin-token"
SALTS = {"token-a": "salt-a", "token-b": "salt-b"}


def remote_section(url: str, prefix: str, **over: Any) -> dict[str, Any]:
    return {"url": url, "group_blocks": G, "key_prefix": prefix, "timeout_s": 0.5, "connect_timeout_s": 0.3,
            "reconnect_min_s": 0.02, "reconnect_max_s": 0.2, "probe_timeout_s": 0.5, **over}


class Fleet:
    """Two daemons on one remote tier (each its own data directory, socket and LMDB)."""

    def __init__(self, url: str, prefix: str, model: dict[str, Any] | None = None,
                 remote: dict[str, Any] | None = None, sections: dict[str, Any] | None = None, **daemon: Any) -> None:
        """``remote``: fields of the remote section over the test's; ``sections``: other sections (host, disk)."""
        self.roots = [short_tmpdir(), short_tmpdir()]
        self.layout = KVLayout(**model) if model is not None else LAYOUT
        self.daemons: list[Daemon] = []
        for root in self.roots:
            over: dict[str, Any] = {"tiers": ["host", "lmdb", "remote"], **(sections or {}),
                                    "remote": remote_section(url, prefix, **(remote or {}))}
            if model is not None:
                over["model"] = model
                over["host"] = {"capacity": 64 * 2048}
            if daemon:
                over["daemon"] = {**daemon, "tcp_port": free_port()} if "tcp_host" in daemon else daemon
            self.daemons.append(start_daemon(write_config(root, **over)))

    def tier(self, i: int, token: str | None = None) -> DaemonTier:
        d = self.daemons[i]
        if token is None:
            return d.tier()
        assert d.tcp is not None
        host, port = d.tcp.rsplit(":", 1)
        client = DaemonClient(LAYOUT, tcp=(host, int(port)), token=token, client_name=f"tenant {token}")
        client.connect(10)
        return DaemonTier(LAYOUT, client)

    def stats(self, i: int) -> dict[str, Any]:
        client = DaemonClient(self.layout, socket_path=self.daemons[i].socket_path, client_name="stats")
        client.connect(10)
        try:
            return client.stats()
        finally:
            client.close()

    def close(self) -> None:
        for d, root in zip(self.daemons, self.roots):
            if d.proc.poll() is None:
                assert d.stop() == 0, d.log.read_text()[-3000:]
            cleanup(d, root)


def store_chain(tier: DaemonTier, chain: list[bytes]) -> None:
    """What an engine does with a prompt the daemon lacks: probe the chain, compute, put its blocks, flush."""
    assert tier.probe(chain, 0) == 0
    assert all(tier.put(chain, [block_for(k) for k in chain]))
    tier.flush()


def read(tier: DaemonTier, keys: list[bytes]) -> list[torch.Tensor | None]:
    dests = empty_blocks(len(keys))
    return [d if ok else None for ok, d in zip(tier.get(keys, dests), dests)]


@pytest.fixture
def fleet(redis_server: RedisServer, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    f = Fleet(redis_server.url, f"{request.node.name}:")
    try:
        yield f
    finally:
        f.close()


def test_a_prefix_stored_through_one_daemon_is_loaded_through_the_other_bit_for_bit(fleet: Fleet) -> None:
    chain = keys_for(10, seed=1)  # two full groups of 4 go remote; the last 2 blocks stay on the first host
    a, b = fleet.tier(0), fleet.tier(1)
    store_chain(a, chain)
    assert b.contains_prefix(chain) == 0  # the other host's own tiers hold nothing
    assert b.probe(chain, 0) == 2 * G  # its remote tier holds both full groups
    got = read(b, chain[: 2 * G])
    for k, blk in zip(chain, got):
        assert blk is not None and torch.equal(blk, block_for(k)), k.hex()
    assert b.contains_prefix(chain[: 2 * G]) == 2 * G  # loaded into its host tier: local from now on
    assert b.probe(chain, 2 * G) == 2 * G  # the partial group never went remote
    sb, sa = fleet.stats(1), fleet.stats(0)
    assert sb["remote"]["hits"] == 2 * G and sb["remote"]["link"]["loads_started"] == 2 * G
    assert sb["remote"]["link"]["loads_failed"] == 0 and sb["remote"]["errors"] == 0
    assert sa["remote"]["groups_stored"] == 2 and sa["remote"]["link"]["groups_queued"] == 2
    body = urllib.request.urlopen(f"{fleet.daemons[1].metrics_url}/metrics", timeout=5).read().decode()
    assert f'kvstore_hits_total{{tier="remote"}} {2 * G}' in body
    assert 'kvstore_tier_bytes_read_total{tier="remote"}' in body
    shown = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--socket", fleet.daemons[1].socket_path],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert shown.returncode == 0, shown.stderr
    assert re.search(rf"^remote .* {2 * G} +0 +100.0%", shown.stdout, re.M), shown.stdout  # hits, misses, hit rate
    assert f"{2 * G} blocks loaded (0 failed)" in shown.stdout
    for t in (a, b):
        t.close()


def test_a_producer_that_never_looks_up_announces_its_chain_and_its_groups_are_shared(fleet: Fleet) -> None:
    chain = keys_for(8, seed=11)
    a, b = fleet.tier(0), fleet.tier(1)
    assert a.probe(chain, len(chain)) == len(chain)  # announce: no lookup, no remote round trip
    assert all(a.put(chain, [block_for(k) for k in chain]))
    a.flush()
    assert b.probe(chain, 0) == 8
    assert fleet.stats(0)["remote"]["link"]["probes"] == 0
    for t in (a, b):
        t.close()


def test_blocks_stored_before_any_lookup_placed_them_are_sent_at_the_next_lookup(fleet: Fleet) -> None:
    chain = keys_for(8, seed=12)
    a, b = fleet.tier(0), fleet.tier(1)
    assert all(a.put(chain, [block_for(k) for k in chain]))  # no chain shown: the daemon cannot group them
    a.flush()
    assert fleet.stats(0)["remote"]["link"]["unplaced"] == 8
    assert b.probe(chain, 0) == 0
    assert a.probe(chain, 0) == 8  # a lookup shows the chain: its stored groups go now
    a.flush()
    assert b.probe(chain, 0) == 8
    for t in (a, b):
        t.close()


def test_a_block_damaged_on_the_server_is_a_miss_never_served(fleet: Fleet, redis_server: RedisServer) -> None:
    import redis

    chain = keys_for(8, seed=2)
    a, b = fleet.tier(0), fleet.tier(1)
    store_chain(a, chain)
    r = redis.Redis.from_url(redis_server.url)
    name = f"test_a_block_damaged_on_the_server_is_a_miss_never_served:{chain[G - 1].hex()}".encode()
    value = bytearray(r.get(name))
    value[-5] ^= 0x10  # one flipped bit in the first group's last block
    r.set(name, bytes(value))
    assert b.probe(chain, 0) == 2 * G  # EXISTS cannot tell: the load finds it
    got = read(b, chain)
    assert got[:G] == [None] * G  # the damaged group is a miss, whole
    assert all(blk is not None and torch.equal(blk, block_for(k)) for k, blk in zip(chain[G:], got[G:]))
    assert fleet.stats(1)["remote"]["corrupt_dropped"] == G and r.get(name) is None  # deleted, counted
    for t in (a, b):
        t.close()


def test_the_same_on_a_redis_cluster(redis_cluster: RedisClusterProcs) -> None:
    fleet = Fleet(redis_cluster.url, "cluster:")
    try:
        chain = keys_for(16, seed=3)
        a, b = fleet.tier(0), fleet.tier(1)
        store_chain(a, chain)
        assert b.probe(chain, 0) == 16
        for k, blk in zip(chain, read(b, chain)):
            assert blk is not None and torch.equal(blk, block_for(k)), k.hex()
        a.close()
        b.close()
    finally:
        fleet.close()


def test_tenants_keep_their_namespace_on_the_shared_server(redis_server: RedisServer) -> None:
    fleet = Fleet(redis_server.url, "tenants:", tcp_host="127.0.0.1", token=TOKEN, tenant_salts=SALTS)
    try:
        chain = keys_for(8, seed=4)
        store_chain(fleet.tier(0, "token-a"), chain)
        assert fleet.tier(1, "token-b").probe(chain, 0) == 0  # another tenant on the other host: nothing
        local = fleet.tier(1)
        assert local.probe(chain, 0) == 0  # nor an untenanted client
        same = fleet.tier(1, "token-a")
        assert same.probe(chain, 0) == 8
        for k, blk in zip(chain, read(same, chain)):
            assert blk is not None and torch.equal(blk, block_for(k))
    finally:
        fleet.close()


@pytest.mark.parametrize("fault", ["paused", "dead"])
def test_a_paused_or_dead_server_never_stalls_or_errors_a_client(tmp_path: Path, fault: str) -> None:
    server = start_server(tmp_path / "redis")
    fleet = Fleet(server.url, "fault:")
    try:
        stored, fresh = keys_for(8, seed=5), keys_for(8, seed=6)
        a, b = fleet.tier(0), fleet.tier(1)
        store_chain(a, stored)
        assert b.probe(stored, 0) == 8
        read(b, stored)
        if fault == "paused":
            os.kill(server.proc.pid, signal.SIGSTOP)
        else:
            server.stop()
        try:
            t0 = time.monotonic()
            other = keys_for(8, seed=7)
            assert b.probe(other, 0) == 0  # a miss, within the probe bound
            assert a.probe(fresh, 0) == 0
            assert all(a.put(fresh, [block_for(k) for k in fresh]))  # stored locally; the group store fails quietly
            a.flush()
            assert [x is not None for x in read(a, fresh)] == [True] * 8
            assert [x is not None for x in read(b, stored)] == [True] * 8  # what it loaded before stays local
            assert time.monotonic() - t0 < 10.0
            assert fleet.stats(0)["remote"]["errors"] + fleet.stats(1)["remote"]["errors"] >= 1
            assert fleet.daemons[0].proc.poll() is None and fleet.daemons[1].proc.poll() is None
        finally:
            if fault == "paused":
                os.kill(server.proc.pid, signal.SIGCONT)
        a.close()
        b.close()
    finally:
        fleet.close()
        if fault == "paused":
            server.stop()


def test_write_through_selective_sends_a_group_only_once_it_was_hit(redis_server: RedisServer) -> None:
    fleet = Fleet(redis_server.url, "selective:", remote={"write": "write_through_selective", "selective_hits": 1})
    try:
        a, b = fleet.tier(0), fleet.tier(1)
        chain = keys_for(8, seed=8)
        store_chain(a, chain)
        assert b.probe(chain, 0) == 0  # stored once, never hit: not shared
        assert a.probe(chain, 0) == 8  # a lookup hits both groups on the first host
        a.flush()
        assert b.probe(chain, 0) == 8
        a.close()
        b.close()
    finally:
        fleet.close()


def test_write_back_sends_the_groups_a_full_disk_evicts(redis_server: RedisServer) -> None:
    fleet = Fleet(redis_server.url, "back:", remote={"write": "write_back"},
                  sections={"host": {"capacity": 8 * LAYOUT.bytes_per_block}, "disk": {"max_size": "1MiB"}})
    try:
        a, b = fleet.tier(0), fleet.tier(1)
        first = keys_for(8, seed=9)
        store_chain(a, first)
        assert b.probe(first, 0) == 0  # on the first host's disk: not sent
        for seed in range(10, 600):  # enough other prompts to evict the first from a 1 MiB disk
            store_chain(a, keys_for(8, seed=seed))
            if b.probe(first, 0) == 8:
                break
        assert a.contains_prefix(first) < 8  # it left the first host's disk...
        assert b.probe(first, 0) == 8  # ...and was sent on its way out
        for k, blk in zip(first, read(b, first)):
            assert blk is not None and torch.equal(blk, block_for(k))
        a.close()
        b.close()
    finally:
        fleet.close()


ENGINE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from connlib import GREEDY, engine_config, prompt
    from connectors import build_connector
    from engine import LLM
    from kvstore.config import load_config

    conn = build_connector(load_config({config!r}))
    llm = LLM(config=engine_config(), connector=conn)
    out = llm.generate([prompt(1, 45)], GREEDY)[0]
    conn.close()  # flushes the daemon tier
    print(json.dumps({{"tokens": out.token_ids, "cached": out.metrics.cached_tokens_by_tier}}))
""")


def test_an_engine_on_the_other_host_decodes_from_the_remote_prefix_equal_to_recompute(
        redis_server: RedisServer) -> None:
    sys.path.insert(0, str(CONNECTOR_TESTS))
    from connlib import GREEDY, capture_logits, engine_config, prompt

    from connectors import build_connector
    from engine import LLM
    from kvstore.config import load_config

    reference = LLM(config=engine_config())
    ref_logits = capture_logits(reference)
    ref = reference.generate([prompt(1, 45)], GREEDY)[0]
    fleet = Fleet(redis_server.url, "engine:", model=ENGINE_MODEL)
    try:
        configs = []
        for i, d in enumerate(fleet.daemons):
            path = fleet.roots[i] / "engine.yaml"
            path.write_text(yaml.safe_dump({"connector": "sidecar", "daemon": {"socket_path": d.socket_path}}))
            configs.append(path)
        res = subprocess.run([sys.executable, "-c", ENGINE.format(tests=str(CONNECTOR_TESTS), config=str(configs[0]))],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
        assert res.returncode == 0, res.stderr
        first = json.loads(res.stdout.strip().splitlines()[-1])
        assert sum(first["cached"].values()) == 0 and first["tokens"] == ref.token_ids
        conn = build_connector(load_config(configs[1]))  # the other host: its daemon's own tiers are empty
        llm = LLM(config=engine_config(), connector=conn)
        logits = capture_logits(llm)
        out = llm.generate([prompt(1, 45)], GREEDY)[0]
        conn.close()
        # 2 groups of 4 blocks of 4, from the daemon's remote tier
        assert out.metrics.cached_tokens_by_tier == {"gpu": 0, "host": 0, "daemon:host": 0, "daemon:disk": 0,
                                                     "daemon:remote": 32}
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(logits[out.request_id], ref_logits[ref.request_id], rtol=1e-5, atol=1e-5)
        assert fleet.stats(1)["remote"]["hits"] == 8
    finally:
        fleet.close()
