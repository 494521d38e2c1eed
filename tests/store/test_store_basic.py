"""Tiered store: lookups by tier, leases, eviction cascade, bit-identical reloads, stats, events."""

from __future__ import annotations

import pytest
import torch

from kvstore.errors import OutOfBlocks

from storelib import LAYOUT, MemoryTier, make_store, prefill, read_lease

BS = LAYOUT.block_size


def toks(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * BS))


def test_gpu_hit_shares_blocks_and_release_balances() -> None:
    s = make_store(write="write_back")
    t = toks(0, 3) + [7]  # a trailing partial block is not cached
    written = prefill(s, t)
    m = s.lookup(t)
    assert (m.num_tokens, m.tokens_in("gpu")) == (3 * BS, 3 * BS)
    lease = s.acquire(m)
    assert lease.resolve() == 3 * BS and lease.tokens_by_tier() == {"gpu": 12, "host": 0, "disk": 0}
    for b, w in zip(lease.block_ids, written):
        assert s.pool.ref_count(b) == 2  # index + lease
        assert torch.equal(s.pool.block(b), w)
    s.release(lease)
    assert all(s.pool.ref_count(b) == 1 for b in lease.block_ids)
    s.check_integrity()


def test_salted_lookups_are_isolated() -> None:
    s = make_store()
    t = toks(0, 2)
    prefill(s, t, salt="tenant-a")
    assert s.lookup(t, "tenant-a").num_tokens == 2 * BS
    assert s.lookup(t, "tenant-b").num_tokens == 0
    assert s.lookup(t).num_tokens == 0


def test_gpu_eviction_spills_to_host_and_reloads_bit_identical() -> None:
    s = make_store(gpu_blocks=4, host_blocks=8, write="write_back")
    a = prefill(s, toks(0, 2), seed=1)
    b = prefill(s, toks(100, 2), seed=2)
    c = prefill(s, toks(200, 2), seed=3)  # pool of 4: the least recently used (a) went to host
    m = s.lookup(toks(0, 2))
    assert m.tiers == ("host", "host")
    assert s.lookup(toks(200, 2)).tiers == ("gpu", "gpu")
    data, lease = read_lease(s, toks(0, 2))
    assert all(torch.equal(x, y) for x, y in zip(data, a))
    assert lease.tokens_by_tier()["host"] == 2 * BS  # type: ignore[attr-defined]
    s.check_integrity()
    # b was the LRU when a came back, so it is on host now; c still on GPU or host, never lost.
    for t, w in ((toks(100, 2), b), (toks(200, 2), c)):
        got, _ = read_lease(s, t)
        assert all(torch.equal(x, y) for x, y in zip(got, w))
    events = s.drain_events()
    kinds = {(e.kind, e.tier) for e in events}
    assert {("stored", "gpu"), ("evicted", "gpu"), ("spilled", "host"), ("loaded", "gpu")} <= kinds


def test_host_full_spills_to_disk_and_disk_reload_goes_through_host() -> None:
    disk = MemoryTier(LAYOUT)
    s = make_store(gpu_blocks=2, host_blocks=2, disk=disk, write="write_back")
    written = {i: prefill(s, toks(1000 * i, 2), seed=i) for i in range(4)}
    assert s.lookup(toks(0, 2)).tiers == ("disk", "disk")
    assert s.lookup(toks(2000, 2)).tiers == ("host", "host")
    assert s.lookup(toks(3000, 2)).tiers == ("gpu", "gpu")
    s.check_integrity()
    data, lease = read_lease(s, toks(0, 2))
    assert lease.tokens_by_tier() == {"gpu": 0, "host": 0, "disk": 2 * BS}  # type: ignore[attr-defined]
    assert all(torch.equal(x, y) for x, y in zip(data, written[0]))
    st = s.stats()
    assert st["disk"]["loaded_blocks"] == 2 and st["host"]["spilled_blocks"] >= 2 and st["disk"]["spilled_blocks"] >= 2
    s.check_integrity()
    for i in range(4):  # every block still reachable and intact
        got, _ = read_lease(s, toks(1000 * i, 2))
        assert len(got) == 2 and all(torch.equal(x, y) for x, y in zip(got, written[i]))
        s.check_integrity()


def test_disk_blocks_found_beyond_the_index() -> None:
    """Blocks another process wrote (on disk, unknown to this index) are found by probing the chain."""
    disk = MemoryTier(LAYOUT)
    writer = make_store(disk=disk, write="write_through")
    written = prefill(writer, toks(0, 3), seed=5)
    writer.flush()
    reader = make_store(disk=disk)
    m = reader.lookup(toks(0, 3) + [1, 2])
    assert m.tiers == ("disk", "disk", "disk")
    data, _ = read_lease(reader, toks(0, 3))
    assert all(torch.equal(x, y) for x, y in zip(data, written))
    assert reader.lookup(toks(0, 3)).tiers == ("gpu", "gpu", "gpu")  # now indexed on GPU (and host)
    reader.check_integrity()


def test_gpu_only_store_drops_lru_when_full() -> None:
    s = make_store(gpu_blocks=4, host_blocks=None)
    prefill(s, toks(0, 2))
    prefill(s, toks(100, 2))
    prefill(s, toks(200, 2))
    assert s.lookup(toks(0, 2)).num_blocks == 0
    assert s.lookup(toks(200, 2)).num_blocks == 2
    assert s.stats()["dropped_blocks"] == 2
    s.check_integrity()


def test_in_use_blocks_are_never_evicted() -> None:
    s = make_store(gpu_blocks=4, host_blocks=None)
    prefill(s, toks(0, 2))
    lease = s.acquire(s.lookup(toks(0, 2)))
    lease.resolve()
    prefill(s, toks(100, 2))  # cached, unused: evictable
    mine = s.allocate(2)  # evicts the toks(100) blocks, never the leased ones
    assert s.lookup(toks(100, 2)).num_blocks == 0
    with pytest.raises(OutOfBlocks):
        s.allocate(1)
    assert s.lookup(toks(0, 2)).tiers == ("gpu", "gpu")
    s.free(mine)
    s.release(lease)
    s.check_integrity()
