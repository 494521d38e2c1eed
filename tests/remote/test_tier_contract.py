"""The tier contract, checked the same way for every tier that stores blocks by key: LMDB, file, slab, and
the remote tier on a real Redis server and a real Valkey server (unchanged: the same protocol),
standalone and cluster (``group_blocks: 1``: one block per value, so any key sequence is a whole
number of groups; grouping has its own tests).

Each tier comes with raw access to its stored values so the damage cases are the same everywhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from remotelib import remote_tier
from tiers_testlib import LAYOUTS, empty_blocks, make_blocks, make_keys

from kvstore.tiers import DiskTier, FileTier, SlabTier
from kvstore.tiers.base import Tier

L = LAYOUTS["float16"]
_prefixes = itertools.count()


@dataclass
class Stored:
    """A tier and raw access to its stored values (``read(key)``, ``write(key, value)``)."""

    tier: Tier
    read: Callable[[bytes], bytes | None]
    write: Callable[[bytes, bytes], None]


def _lmdb(tmp: Path, request: pytest.FixtureRequest) -> Stored:
    tier = DiskTier(L, tmp, 16 << 20)

    def read(key: bytes) -> bytes | None:
        with tier.env.begin(db=tier._blocks) as txn:
            v = txn.get(key)
            return None if v is None else bytes(v)

    def write(key: bytes, value: bytes) -> None:
        with tier.env.begin(write=True, db=tier._blocks) as txn:
            txn.put(key, value)

    return Stored(tier, read, write)


def _file(tmp: Path, request: pytest.FixtureRequest) -> Stored:
    tier = FileTier(L, tmp, 16 << 20)

    def read(key: bytes) -> bytes | None:
        p = Path(tier.path_of(key))
        return p.read_bytes() if p.exists() else None

    return Stored(tier, read, lambda key, value: Path(tier.path_of(key)).write_bytes(value))


def _slab(tmp: Path, request: pytest.FixtureRequest) -> Stored:
    tier = SlabTier(L, tmp, 16 << 20)

    def read(key: bytes) -> bytes | None:
        slot = tier._slots.get(key)
        if slot is None:
            return None
        with open(tier.data.path, "rb") as f:
            f.seek(slot * tier.slot_size)
            return f.read(tier.value_len)

    def write(key: bytes, value: bytes) -> None:  # the whole slot: a shorter value leaves zeros, not old bytes
        with open(tier.data.path, "r+b") as f:
            f.seek(tier._slots[key] * tier.slot_size)
            f.write(value.ljust(tier.slot_size, b"\0"))

    return Stored(tier, read, write)


def _redis_on(url: str, raw: Any) -> Stored:
    tier = remote_tier(L, url, group_blocks=1, key_prefix=f"contract{next(_prefixes)}:")
    return Stored(tier, lambda key: raw.get(tier.redis_key(key)), lambda key, value: raw.set(tier.redis_key(key), value))


def _server(fixture: str) -> Callable[[Path, pytest.FixtureRequest], Stored]:
    def make(tmp: Path, request: pytest.FixtureRequest) -> Stored:
        import redis

        server = request.getfixturevalue(fixture)
        return _redis_on(server.url, redis.Redis(port=server.port))

    return make


def _cluster(fixture: str) -> Callable[[Path, pytest.FixtureRequest], Stored]:
    def make(tmp: Path, request: pytest.FixtureRequest) -> Stored:
        from redis.cluster import ClusterNode, RedisCluster

        cluster = request.getfixturevalue(fixture)
        return _redis_on(cluster.url, RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", cluster.servers[0].port)]))

    return make


MAKERS = {"lmdb": _lmdb, "file": _file, "slab": _slab, "redis": _server("redis_server"), "redis-cluster": _cluster("redis_cluster"),
          "valkey": _server("valkey_server"), "valkey-cluster": _cluster("valkey_cluster")}


@pytest.fixture(params=sorted(MAKERS))
def stored(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stored]:
    s = MAKERS[request.param](tmp_path, request)
    try:
        yield s
    finally:
        s.tier.close()


def test_round_trip_bit_identical_and_unknown_keys_miss(stored: Stored) -> None:
    tier = stored.tier
    keys, blocks = make_keys(L, 6, seed=1), make_blocks(L, 6, seed=1)
    assert tier.put(keys[:5], blocks[:5]) == [True] * 5
    dests = empty_blocks(L, 6)
    assert tier.get(keys, dests) == [True] * 5 + [False]
    assert all(torch.equal(d, b) for d, b in zip(dests[:5], blocks[:5]))
    s = tier.stats()
    assert (s.hits, s.misses, s.puts, s.bytes_read) == (5, 1, 5, 5 * L.bytes_per_block)


def test_contains_prefix_stops_at_the_first_gap(stored: Stored) -> None:
    tier = stored.tier
    keys, blocks = make_keys(L, 6, seed=2), make_blocks(L, 6, seed=2)
    tier.put(keys[:3] + keys[4:], blocks[:3] + blocks[4:])
    assert tier.contains_prefix(keys) == 3 and tier.contains_prefix(keys[4:]) == 2 and tier.contains_prefix(keys[3:]) == 0
    assert tier.contains(keys[0]) and not tier.contains(keys[3])


def test_put_of_a_stored_key_changes_nothing(stored: Stored) -> None:
    tier = stored.tier
    keys, blocks = make_keys(L, 2, seed=3), make_blocks(L, 2, seed=3)
    tier.put(keys, blocks)
    before = stored.read(keys[0])
    assert tier.put(keys[:1], make_blocks(L, 1, seed=99)) == [True]  # content addressing: the first copy stays
    assert stored.read(keys[0]) == before and tier.stats().puts == 2
    dest = empty_blocks(L, 1)
    assert tier.get(keys[:1], dest) == [True] and torch.equal(dest[0], blocks[0])


def test_delete_counts_and_then_misses(stored: Stored) -> None:
    tier = stored.tier
    keys, blocks = make_keys(L, 3, seed=4), make_blocks(L, 3, seed=4)
    tier.put(keys[:2], blocks[:2])
    assert tier.delete(keys) == 2 and tier.delete(keys) == 0
    assert tier.get(keys[:1], empty_blocks(L, 1)) == [False] and tier.contains_prefix(keys) == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "misplaced"])
def test_damaged_value_is_detected_deleted_counted_and_a_miss(stored: Stored, damage: str) -> None:
    tier = stored.tier
    keys, blocks = make_keys(L, 2, seed=5), make_blocks(L, 2, seed=5)
    tier.put(keys, blocks)
    value = stored.read(keys[0])
    assert value is not None
    bad = {"flip": value[:70] + bytes([value[70] ^ 1]) + value[71:], "truncate": value[:-5],
           "misplaced": stored.read(keys[1])}[damage]
    assert bad is not None
    stored.write(keys[0], bad)
    tier.drain_events()
    assert tier.get(keys, empty_blocks(L, 2)) == [False, True]
    s = tier.stats()
    assert (s.corrupt_dropped, s.misses, s.hits) == (1, 1, 1)
    assert [(e.kind, e.key) for e in tier.drain_events()] == [("corrupt", keys[0])]
    assert stored.read(keys[0]) is None and tier.contains_prefix(keys) == 0
    assert tier.put(keys[:1], blocks[:1]) == [True]  # a clean copy can be stored again
    dest = empty_blocks(L, 1)
    assert tier.get(keys[:1], dest) == [True] and torch.equal(dest[0], blocks[0])


def test_async_calls_return_futures_with_the_same_results(stored: Stored) -> None:
    tier = stored.tier
    keys, blocks = make_keys(L, 4, seed=6), make_blocks(L, 4, seed=6)
    assert tier.put_async(keys, blocks).result(timeout=10) == [True] * 4
    dests = empty_blocks(L, 4)
    assert tier.get_async(keys, dests).result(timeout=10) == [True] * 4
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks))


def test_wrong_buffers_are_refused_naming_the_block(stored: Stored) -> None:
    keys = make_keys(L, 1, seed=7)
    with pytest.raises(ValueError, match=f"block {keys[0][:8].hex()}"):
        stored.tier.put(keys, [torch.zeros(3, dtype=torch.uint8)])
