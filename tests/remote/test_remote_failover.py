"""Killing a Redis Cluster primary while engines read and write: only misses and counted errors, never an
exception or a hang; after the replica takes over (``cluster-node-timeout`` 500 ms) the tier works again."""

from __future__ import annotations

import threading
import time

import torch
from remotelib import remote_tier, wait_for
from tiers_testlib import LAYOUTS, empty_blocks, make_blocks, make_keys

from benchmarks.redis_servers import RedisClusterProcs

L = LAYOUTS["float16"]
G = 2


def test_killing_a_primary_gives_misses_and_errors_then_recovers(redis_cluster: RedisClusterProcs) -> None:
    tier = remote_tier(L, redis_cluster.url, group_blocks=G, timeout_s=0.3, connect_timeout_s=0.2)
    chains = [(make_keys(L, 8, seed=i), make_blocks(L, 8, seed=i)) for i in range(20)]
    for keys, blocks in chains:
        assert tier.put(keys, blocks) == [True] * 8
    stop = threading.Event()
    failures: list[BaseException] = []
    longest = 0.0
    rounds = 0

    def traffic() -> None:
        nonlocal longest, rounds
        i = 1000
        while not stop.is_set():
            try:
                t0 = time.monotonic()
                keys, blocks = make_keys(L, 4, seed=i), make_blocks(L, 4, seed=i)
                tier.put(keys, blocks)
                for ck, _ in chains[:5]:
                    n = tier.probe(ck)
                    tier.load(ck, 0, empty_blocks(L, n))
                longest = max(longest, time.monotonic() - t0)
                rounds += 1
                i += 1
            except BaseException as exc:  # noqa: BLE001 - the assertion below reports it
                failures.append(exc)
                return

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        wait_for(lambda: rounds >= 3, 10, "traffic before the kill")
        victim = redis_cluster.masters()[0]
        victim.kill()  # SIGKILL by pid: a crash, no goodbye
        redis_cluster.wait_healthy(30)  # a replica took over its slots
        fresh, blocks = make_keys(L, 8, seed=999), make_blocks(L, 8, seed=999)
        wait_for(lambda: tier.put(fresh, blocks) == [True] * 8, 15, "writes to succeed after the failover")
        dests = empty_blocks(L, 8)
        assert tier.get(fresh, dests) == [True] * 8 and all(torch.equal(d, b) for d, b in zip(dests, blocks))
    finally:
        stop.set()
        worker.join(30)
    assert failures == [], failures
    assert longest < 10.0, f"one round of traffic took {longest:.1f} s"
    s = tier.stats()
    assert s.errors + s.skipped > 0  # the outage was seen and counted
    for keys, blocks in chains:  # what survived (replicated before the kill) loads intact
        n = tier.probe(keys)
        dests = empty_blocks(L, n)
        assert tier.load(keys, 0, dests) == [True] * n
        assert all(torch.equal(d, b) for d, b in zip(dests, blocks[:n]))
    assert tier.stats().corrupt_dropped == 0
    tier.close()
