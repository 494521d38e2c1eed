"""Redis evicts (``maxmemory`` + ``allkeys-lru``): no errors, a probe reports only blocks that load intact
while nothing else evicts, a group lost between probe and load is a counted miss cut at that group, and
evictions reach the tier's stats, from keyspace notifications or from failed reads."""

from __future__ import annotations

from pathlib import Path

import torch
from remotelib import remote_tier, wait_for
from tiers_testlib import BIG, empty_blocks, make_blocks, make_keys

from benchmarks.redis_servers import start_server

G = 4
CHAINS = 40
BLOCKS = 16  # 4 groups of 4 x 7.5 KiB blocks: ~31 KiB per value, ~5 MB in all


def test_small_maxmemory_evicts_groups_without_errors_and_probes_stay_loadable(tmp_path: Path) -> None:
    server = start_server(tmp_path / "small", maxmemory="3mb", notify="Exe")
    tier = remote_tier(BIG, server.url, group_blocks=G)
    try:
        assert tier._listener is not None and tier._listener.wait_subscribed(5)
        chains = [(make_keys(BIG, BLOCKS, seed=i), make_blocks(BIG, BLOCKS, seed=i)) for i in range(CHAINS)]
        for keys, blocks in chains:
            assert tier.put(keys, blocks) == [True] * BLOCKS  # maxmemory is never an error: Redis makes room
        wait_for(lambda: tier.stats().evictions_notified > 0, 5, "eviction notifications")
        # Redis sits at maxmemory now, and any reply buffer (a GET's) makes it evict again: a group the
        # probe saw can go before the load reads it (test_group_lost_between_probe_and_load). Lift the
        # limit so what the probe reports is what is stored.
        server.cli("CONFIG", "SET", "maxmemory", "0")
        surviving = 0
        for keys, blocks in chains:
            n = tier.probe(keys)
            assert n % G == 0
            dests = empty_blocks(BIG, n)
            assert tier.load(keys, 0, dests) == [True] * n, "the probe reported a block it could not load"
            assert all(torch.equal(d, b) for d, b in zip(dests, blocks[:n]))
            surviving += n
        s = tier.stats()
        assert 0 < surviving < CHAINS * BLOCKS
        assert s.errors == 0 and s.corrupt_dropped == 0
        assert s.evictions == s.evictions_notified + s.evictions_inferred and s.evictions_notified % G == 0
        assert {e.kind for e in tier.drain_events()} == {"evicted"}
        # Without notifications a read that finds no value is the eviction signal.
        server.cli("CONFIG", "SET", "notify-keyspace-events", "")
        before = tier.stats().evictions_inferred
        for keys, _ in chains:
            tier.load(keys, 0, empty_blocks(BIG, BLOCKS))
        assert tier.stats().evictions_inferred > before
    finally:
        tier.close()
        server.stop()


def test_group_lost_between_probe_and_load_is_a_counted_miss_cut_at_that_group(tmp_path: Path) -> None:
    server = start_server(tmp_path / "lost", notify="Exe")
    tier = remote_tier(BIG, server.url, group_blocks=G)
    try:
        keys, blocks = make_keys(BIG, BLOCKS, seed=7), make_blocks(BIG, BLOCKS, seed=7)
        assert tier.put(keys, blocks) == [True] * BLOCKS
        assert tier.probe(keys) == BLOCKS
        server.cli("DEL", tier.redis_key(keys[2 * G + G - 1]).decode())  # the third group, as an eviction would
        dests = empty_blocks(BIG, BLOCKS)
        before = tier.stats()
        got = tier.load(keys, 0, dests)
        assert got == [True] * (2 * G) + [False] * G + [True] * G  # the lost group only; the store cuts at it
        assert all(torch.equal(d, b) for d, b in zip(dests[: 2 * G], blocks[: 2 * G]))
        s = tier.stats()
        assert s.evictions_inferred - before.evictions_inferred == G and s.errors == 0
        assert s.misses - before.misses == G
        assert tier.probe(keys) == 2 * G
    finally:
        tier.close()
        server.stop()
