"""The remote tier on one real ``redis-server``: groups, probes cut at the first gap, integrity with
SETRANGE damage, tenants, the byte bound, AUTH and ACL users, and degradation when the server is
down, paused or refusing."""

from __future__ import annotations

import itertools
import shutil
import threading
import time
from pathlib import Path

import pytest
import redis
import torch
from remotelib import remote_tier, wait_for
from tiers_testlib import BIG, LAYOUTS, empty_blocks, make_blocks, make_keys

from benchmarks.redis_servers import RedisServer, make_tls_files, start_server
from kvstore.tiers.codec import HEADER_SIZE
from kvstore.tiers.redis.client import parse_target

L = LAYOUTS["float16"]
_prefixes = itertools.count()


def _tier(server: RedisServer, **over: object):  # type: ignore[no-untyped-def]
    over.setdefault("key_prefix", f"groups{next(_prefixes)}:")
    return remote_tier(L, server.url, **over)


def test_full_groups_only_each_under_its_last_key(redis_server: RedisServer) -> None:
    tier = _tier(redis_server, group_blocks=4)
    raw = redis.Redis(port=redis_server.port)
    keys, blocks = make_keys(L, 10, seed=1), make_blocks(L, 10, seed=1)
    assert tier.put(keys, blocks) == [True] * 8 + [False] * 2
    stored = sorted(raw.keys(tier.cfg.key_prefix + "*"))
    assert stored == sorted([tier.redis_key(keys[3]), tier.redis_key(keys[7])])
    assert len(raw.get(tier.redis_key(keys[3])) or b"") == 4 * (HEADER_SIZE + L.bytes_per_block)
    assert tier.stats().groups_stored == 2 and tier.stats().puts == 8
    assert tier.probe(keys) == 8 and tier.contains_prefix(keys) == 8
    dests = empty_blocks(L, 3)
    assert tier.load(keys, 5, dests) == [True, True, True]  # positions 5..7, inside group 1
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks[5:8]))
    assert tier.load(keys, 7, empty_blocks(L, 2)) == [True, False]  # position 8 is in a partial group
    tier.close()


def test_probe_is_cut_at_the_first_missing_group_and_may_start_late(redis_server: RedisServer) -> None:
    tier = _tier(redis_server, group_blocks=2)
    keys, blocks = make_keys(L, 8, seed=2), make_blocks(L, 8, seed=2)
    tier.put(keys, blocks)
    assert tier.delete([keys[3]]) == 1  # group 1 (positions 2, 3)
    assert tier.probe(keys) == 2
    assert tier.probe(keys, start=4) == 8 and tier.probe(keys, start=5) == 8  # groups before start are assumed
    assert tier.probe(keys, start=2) == 2
    tier.close()


@pytest.mark.parametrize("damage", ["setrange", "short", "long"])
def test_damaged_group_is_detected_deleted_counted_and_a_miss(redis_server: RedisServer, damage: str) -> None:
    tier = _tier(redis_server, group_blocks=4)
    raw = redis.Redis(port=redis_server.port)
    keys, blocks = make_keys(L, 8, seed=3), make_blocks(L, 8, seed=3)
    tier.put(keys, blocks)
    rkey = tier.redis_key(keys[3])
    value = raw.get(rkey)
    assert value is not None
    if damage == "setrange":  # one byte inside block 2's payload
        off = 2 * (HEADER_SIZE + L.bytes_per_block) + HEADER_SIZE + 17
        raw.setrange(rkey, off, bytes([value[off] ^ 0x40]))
    else:
        raw.set(rkey, value[:-10] if damage == "short" else value + b"x")
    tier.drain_events()
    dests = empty_blocks(L, 8)
    assert tier.load(keys, 0, dests) == [False] * 4 + [True] * 4
    assert all(torch.equal(d, b) for d, b in zip(dests[4:], blocks[4:]))
    s = tier.stats()
    assert (s.corrupt_dropped, s.misses, s.hits) == (4, 4, 4)
    assert [(e.kind, e.key) for e in tier.drain_events()] == [("corrupt", keys[3])]
    assert raw.exists(rkey) == 0 and tier.probe(keys) == 0
    tier.close()


def test_tenants_never_reach_each_others_groups(redis_server: RedisServer) -> None:
    tier = _tier(redis_server, group_blocks=2)
    a, b = make_keys(L, 4, seed=4, salt="tenant-a"), make_keys(L, 4, seed=4, salt="tenant-b")
    assert not set(a) & set(b)  # same tokens, other tenant: other keys (and another layout would too)
    tier.put(a, make_blocks(L, 4))
    assert tier.probe(a) == 4 and tier.probe(b) == 0 and tier.load(b, 0, empty_blocks(L, 4)) == [False] * 4
    other_layout = make_keys(LAYOUTS["bfloat16"], 4, seed=4, salt="tenant-a")
    assert tier.probe(other_layout) == 0
    tier.close()


def test_bytes_in_flight_stay_under_the_bound(redis_server: RedisServer) -> None:
    value = 2 * (HEADER_SIZE + BIG.bytes_per_block)
    tier = remote_tier(BIG, redis_server.url, group_blocks=2, max_inflight_bytes=value, key_prefix="bound:")
    peak = 0
    acquire = tier._budget.acquire

    def spy(n: int, timeout: float | None = None) -> bool:
        nonlocal peak
        ok = acquire(n, timeout)
        peak = max(peak, tier._budget.in_flight)
        return ok

    tier._budget.acquire = spy  # type: ignore[method-assign]
    keys, blocks = make_keys(BIG, 12, seed=5), make_blocks(BIG, 12, seed=5)
    assert tier.put(keys, blocks) == [True] * 12
    dests = empty_blocks(BIG, 12)
    assert tier.get(keys, dests) == [True] * 12 and all(torch.equal(d, b) for d, b in zip(dests, blocks))
    assert 0 < peak <= value
    tier.close()


def test_a_stopped_server_means_misses_and_counted_errors_then_a_reconnect(tmp_path: Path) -> None:
    server = start_server(tmp_path / "r")
    tier = remote_tier(L, server.url, group_blocks=2, listen_evictions=False)
    keys, blocks = make_keys(L, 4, seed=6), make_blocks(L, 4, seed=6)
    assert tier.put(keys, blocks) == [True] * 4
    server.stop()
    t0 = time.monotonic()
    assert tier.get(keys, empty_blocks(L, 4)) == [False] * 4
    assert tier.probe(keys) == 0 and tier.put(keys, blocks) == [False] * 4 and not tier.contains(keys[1])
    assert time.monotonic() - t0 < 2.0  # one connect timeout at most, then back-off: never a hang
    s = tier.stats()
    assert s.errors >= 1 and s.errors + s.skipped >= 4 and s.misses == 4
    server = start_server(tmp_path / "r2", port=server.port)
    try:
        wait_for(lambda: tier.put(keys, blocks) == [True] * 4, 5, "the tier to reconnect")
        dests = empty_blocks(L, 4)
        assert tier.get(keys, dests) == [True] * 4 and all(torch.equal(d, b) for d, b in zip(dests, blocks))
        assert tier.stats().reconnects == 1
    finally:
        tier.close()
        server.stop()


def test_a_paused_server_costs_one_timeout_not_a_hang(redis_server: RedisServer) -> None:
    tier = _tier(redis_server, group_blocks=2, timeout_s=0.2, listen_evictions=False)
    keys, blocks = make_keys(L, 4, seed=7), make_blocks(L, 4, seed=7)
    tier.put(keys, blocks)
    raw = redis.Redis(port=redis_server.port)
    raw.execute_command("CLIENT", "PAUSE", "1500", "ALL")
    try:
        t0 = time.monotonic()
        assert tier.get(keys, empty_blocks(L, 4)) == [False] * 4
        assert time.monotonic() - t0 < 1.0 and tier.stats().errors == 1
    finally:
        raw.execute_command("CLIENT", "UNPAUSE")
    wait_for(lambda: tier.get(keys, empty_blocks(L, 4)) == [True] * 4, 5, "reads after the pause")
    tier.close()


def test_auth_by_password_and_by_acl_user(tmp_path: Path) -> None:
    server = start_server(tmp_path / "auth", password="s3cret")
    try:
        server.cli("ACL", "SETUSER", "kv", "on", ">kvpass", "~kvstore:*", "+@all")
        keys, blocks = make_keys(L, 2, seed=8), make_blocks(L, 2, seed=8)
        for url, over in [(server.url, {}), (f"redis://127.0.0.1:{server.port}/0", {"username": "kv", "password": "kvpass"}),
                          (f"redis://kv:kvpass@127.0.0.1:{server.port}/0", {})]:
            tier = remote_tier(L, url, group_blocks=2, listen_evictions=False, **over)
            assert tier.put(keys, blocks) == [True, True] and tier.probe(keys) == 2, url
            tier.close()
        anonymous = remote_tier(L, f"redis://127.0.0.1:{server.port}/0", group_blocks=2, listen_evictions=False)
        assert anonymous.probe(keys) == 0 and anonymous.stats().errors == 1  # NOAUTH: a counted error, a miss
        anonymous.close()
        wrong = remote_tier(L, f"redis://kv:nope@127.0.0.1:{server.port}/0", group_blocks=2, listen_evictions=False)
        assert wrong.get(keys, empty_blocks(L, 2)) == [False, False] and wrong.stats().errors == 1
        wrong.close()
    finally:
        server.stop()


def test_urls_name_tls_cluster_and_credentials() -> None:
    t, user, pw = parse_target("rediss-cluster://u:p%40ss@h1:7000,[::1]:7001")
    assert (t.cluster, t.tls, t.nodes, user, pw) == (True, True, (("h1", 7000), ("::1", 7001)), "u", "p@ss")
    assert t.describe() == "rediss-cluster://h1:7000,::1:7001"  # no credentials in logs
    t, user, pw = parse_target("rediss://:pw@cache.example:6380/2")
    assert (t.cluster, t.tls, t.nodes, user, pw) == (False, True, (("cache.example", 6380),), None, "pw")
    with pytest.raises(ValueError, match="names one server"):
        parse_target("redis://a:1,b:2")
    with pytest.raises(ValueError, match="'a' is not host:port"):
        parse_target("redis-cluster://a")


def test_concurrent_readers_and_writers_share_one_tier(redis_server: RedisServer) -> None:
    tier = _tier(redis_server, group_blocks=2, io_threads=4)
    chains = [(make_keys(L, 6, seed=100 + i), make_blocks(L, 6, seed=100 + i)) for i in range(8)]
    errors: list[BaseException] = []

    def work(keys: list[bytes], blocks: list[torch.Tensor]) -> None:
        try:
            assert tier.put_async(keys, blocks).result(10) == [True] * 6
            dests = empty_blocks(L, 6)
            assert tier.get_async(keys, dests).result(10) == [True] * 6
            assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=c) for c in chains]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == [] and tier.stats().hits == 48
    tier.close()


def test_tls_url_with_a_private_ca(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not on PATH: cannot make a test certificate")
    server = start_server(tmp_path / "tls", tls_dir=make_tls_files(tmp_path / "certs"))
    try:
        assert server.url.startswith("rediss://")
        keys, blocks = make_keys(L, 2, seed=9), make_blocks(L, 2, seed=9)
        tier = remote_tier(L, server.url, group_blocks=2, listen_evictions=False,
                           tls_ca_file=str(tmp_path / "certs" / "ca.crt"))
        assert tier.put(keys, blocks) == [True, True]
        dests = empty_blocks(L, 2)
        assert tier.get(keys, dests) == [True, True] and torch.equal(dests[1], blocks[1])
        tier.close()
        plain = remote_tier(L, server.url.replace("rediss://", "redis://"), group_blocks=2, listen_evictions=False)
        assert plain.probe(keys) == 0 and plain.stats().errors == 1  # plain text to a TLS port: a counted error
        plain.close()
    finally:
        server.stop()
