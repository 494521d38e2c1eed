"""``remote.write: write_back`` below a disk tier: a block's full group goes to Redis when the last local tier,
the LMDB, file or slab tier, evicts the block (the tier's victim hook). Never before, never a partial group, each
group once; a dead server never holds up the disk's eviction."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis
from policylib import G, loads_back, new_prefix, policy_store, prompt
from storelib import LAYOUT, MemoryTier, prefill

from benchmarks.redis_servers import RedisServer, start_server
from kvstore.config.schema import PolicyConfig
from kvstore.store.tiered import TieredStore
from kvstore.tiers.base import Buffer, Tier
from kvstore.tiers.lmdb.tier import DiskTier
from kvstore.tiers.file import FileTier
from kvstore.tiers.slab.tier import SlabTier

DISK_BLOCKS = {"file": 12, "slab": 12, "lmdb": 11}
"""Blocks each small disk tier holds (a file or a slot takes one 4 KiB block; LMDB's 22 pages keep 11 blocks of
this layout)."""
LATE_S = 30.0
"""How long the late server holds each answer: an eviction that waited for one would take at least this long
(the disk's own fsyncs take seconds on a loaded 2-core machine, so the bound is half of it, not a tight one)."""
WRITE_BACK = PolicyConfig(write="write_back")  # local tiers too: a block leaves the GPU only when evicted


@pytest.fixture(params=["file", "lmdb", "slab"])
def small_disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    """A disk tier of a few blocks (:data:`DISK_BLOCKS`)."""
    kind: str = request.param
    disk: Tier
    if kind == "file":
        disk = FileTier(LAYOUT, tmp_path / "files", DISK_BLOCKS[kind] * 4096)
    elif kind == "slab":
        disk = SlabTier(LAYOUT, tmp_path / "slab", DISK_BLOCKS[kind] * 4096)
    else:
        disk = DiskTier(LAYOUT, tmp_path / "lmdb", 22 * 4096)
    yield disk
    disk.close()


def _redis_keys(url: str, prefix: str) -> set[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return set(client.scan_iter(match=prefix + "*"))
    finally:
        client.close()


def _groups_gone_from_disk(store: TieredStore, disk: Tier, prompts: list[list[int]]) -> set[bytes]:
    """Redis keys of the full groups of ``prompts`` one block of which the disk tier no longer holds."""
    remote = store.h.remote
    assert remote is not None
    out: set[bytes] = set()
    for toks in prompts:
        keys = store.keys(toks)
        for start in range(0, len(keys) // G * G, G):
            if not all(disk.contains(k) for k in keys[start:start + G]):
                out.add(remote.redis_key(keys[start + G - 1]))
    return out


def _remote_counts(store: TieredStore) -> tuple[int, int, int]:
    st = store.stats()["remote"]
    return st["groups_stored"], st["spilled_blocks"], st["skipped_groups"]


def test_write_back_sends_the_groups_the_disk_evicts(redis_server: RedisServer, small_disk: Tier) -> None:
    prefix = new_prefix("wbd")
    store = policy_store(redis_server.url, prefix, "write_back", host=False, disk=small_disk, local=WRITE_BACK)
    a = prompt(10, seed=7)  # two full groups and a partial one (blocks 8, 9)
    data_a = prefill(store, a, seed=7)
    assert store.offload("gpu") == 10  # all of it on disk now, nowhere else
    store.flush()
    assert small_disk.stats().evictions == 0
    assert _redis_keys(redis_server.url, prefix) == set()  # on disk: not yet
    b = prompt(10, seed=8)
    prefill(store, b, seed=8)
    store.offload("gpu")  # 20 blocks into a disk of 11-12: the disk evicts, its victims' groups go remote
    store.flush()
    assert small_disk.stats().evictions >= 20 - DISK_BLOCKS[small_disk.name]
    sent = _groups_gone_from_disk(store, small_disk, [a, b])
    assert sent and _redis_keys(redis_server.url, prefix) == sent  # exactly those groups: no partial one
    assert _remote_counts(store) == (len(sent), G * len(sent), 0)
    c = prompt(12, seed=9)
    prefill(store, c, seed=9)
    store.offload("gpu")  # evicts the rest of a and b, block by block: each group still goes once
    store.flush()
    sent = _groups_gone_from_disk(store, small_disk, [a, b, c])
    assert {store.h.remote.redis_key(store.keys(t)[i]) for t in (a, b) for i in (3, 7)} <= sent  # type: ignore[union-attr]
    assert _redis_keys(redis_server.url, prefix) == sent
    assert _remote_counts(store) == (len(sent), G * len(sent), 0)  # every group sent once, none skipped
    store.check_integrity()
    store.close()
    loads_back(redis_server.url, prefix, a, data_a)  # a fresh engine with empty local tiers gets a from Redis


def test_write_back_sends_disk_victims_the_gpu_still_holds_once(redis_server: RedisServer, small_disk: Tier) -> None:
    """Under the local ``write_through`` every block is on disk from its commit, and the disk evicts blocks the
    GPU and host still hold: their groups go remote then (the disk is the last local tier), and the later
    GPU and host evictions do not send them again."""
    prefix = new_prefix("wbd")
    store = policy_store(redis_server.url, prefix, "write_back", host=True, disk=small_disk)
    prompts = [prompt(8, seed=s) for s in (10, 11, 12)]
    prefill(store, prompts[0], seed=10)  # written through to the host tier and the disk at commit
    assert _redis_keys(redis_server.url, prefix) == set() and small_disk.stats().evictions == 0
    for s, toks in zip((11, 12), prompts[1:]):
        prefill(store, toks, seed=s)
    store.flush()
    assert small_disk.stats().evictions >= 24 - DISK_BLOCKS[small_disk.name]
    sent = _groups_gone_from_disk(store, small_disk, prompts)
    assert sent and _redis_keys(redis_server.url, prefix) == sent
    assert store.lookup(prompts[0]).tiers == ("gpu",) * 8  # the local copies stay
    store.offload("gpu")
    store.offload("host")  # the host copies go back to disk (sent groups too), evicting again
    store.flush()
    sent |= _groups_gone_from_disk(store, small_disk, prompts)
    assert _redis_keys(redis_server.url, prefix) == sent
    assert _remote_counts(store) == (len(sent), G * len(sent), 0)
    store.check_integrity()
    store.close()


def test_a_dead_server_never_holds_up_the_disk_eviction(tmp_path: Path, small_disk: Tier) -> None:
    server = start_server(tmp_path / "redis")
    prefix = new_prefix("wbd")
    store = policy_store(server.url, prefix, "write_back", host=False, disk=small_disk, local=WRITE_BACK)
    try:
        prefill(store, prompt(10, seed=13), seed=13)
        store.offload("gpu")
        store.flush()
        server.stop()
        prefill(store, prompt(10, seed=14), seed=14)
        t0 = time.monotonic()
        store.offload("gpu")  # the disk evicts; the victims' groups are copied and their sends fail
        store.flush()
        assert time.monotonic() - t0 < 5.0
        disk = small_disk.stats()
        assert disk.evictions >= 20 - DISK_BLOCKS[small_disk.name] and disk.num_blocks <= DISK_BLOCKS[small_disk.name]
        st = store.stats()["remote"]
        assert st["errors"] >= 1 and st["groups_stored"] == 0 and st["spilled_blocks"] == 0
        store.check_integrity()
    finally:
        store.close()
        server.stop()


def test_a_slow_server_sheds_groups_beyond_the_queue_bound(redis_server: RedisServer, small_disk: Tier) -> None:
    """While the writer waits on a late answer, the disk keeps evicting; copies beyond ``max_queued_bytes``
    are shed (counted, not remembered as sent), never queued without bound nor waited for."""
    prefix = new_prefix("wbd")
    store = policy_store(redis_server.url, prefix, "write_back", host=False, disk=small_disk, local=WRITE_BACK)
    writer, remote = store.remote_writer, store.h.remote
    assert writer is not None and remote is not None
    writer.policy.max_queued_bytes = G * LAYOUT.bytes_per_block  # one group's copies
    answer = threading.Event()
    store_now = remote.store

    def late(chain: Sequence[bytes], start: int, srcs: Sequence[Buffer]) -> int:
        answer.wait(LATE_S)
        return store_now(chain, start, srcs)

    remote.store = late  # type: ignore[method-assign]  # a server that answers late
    toks = prompt(20, seed=15)
    prefill(store, toks, seed=15)
    t0 = time.monotonic()
    store.offload("gpu")  # 20 blocks into 11-12: the first evicted group is queued, the others shed
    assert time.monotonic() - t0 < LATE_S / 2 and small_disk.stats().evictions >= 20 - DISK_BLOCKS[small_disk.name]
    gone = _groups_gone_from_disk(store, small_disk, [toks])
    answer.set()
    store.flush()
    assert len(gone) >= 2 and len(_redis_keys(redis_server.url, prefix)) == 1
    st = store.stats()["remote"]
    assert (st["groups_stored"], st["skipped_groups"]) == (1, 0) and st["shed_groups"] >= len(gone) - 1
    store.check_integrity()
    store.close()


def test_write_back_refuses_a_disk_tier_that_cannot_show_its_victims(redis_server: RedisServer) -> None:
    """A disk tier without a victim hook (a daemon's) would lose every group it evicts: refused at build."""
    silent = MemoryTier(LAYOUT)
    assert not silent.takes_victim_hook
    with pytest.raises(ValueError, match="remote write_back needs a disk tier that shows its victims"):
        policy_store(redis_server.url, new_prefix("wbd"), "write_back", host=False, disk=silent)
