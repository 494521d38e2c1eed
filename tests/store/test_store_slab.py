"""Tiered store over the real slab disk tier: spills, reloads bit-identical, the slab's evictions reach the index,
and a second store in a new tier instance finds what the first wrote."""

from __future__ import annotations

from pathlib import Path

import torch

from kvstore.tiers import SlabTier

from storelib import LAYOUT, make_store, prefill, read_lease

BS = LAYOUT.block_size


def toks(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * BS))


def slab(path: Path, slots: int) -> SlabTier:
    return SlabTier(LAYOUT, path, slots * 4096)  # one 4 KiB slot per block of this small layout


def test_host_victims_go_to_the_slab_and_come_back_bit_identical(tmp_path: Path) -> None:
    disk = slab(tmp_path, 64)
    s = make_store(gpu_blocks=2, host_blocks=2, disk=disk, write="write_back")
    written = {i: prefill(s, toks(1000 * i, 2), seed=i) for i in range(4)}
    assert s.lookup(toks(0, 2)).tiers == ("disk", "disk")
    data, lease = read_lease(s, toks(0, 2))
    assert lease.tokens_by_tier() == {"gpu": 0, "host": 0, "disk": 2 * BS}  # type: ignore[attr-defined]
    assert all(torch.equal(x, y) for x, y in zip(data, written[0]))
    for i in range(4):
        got, _ = read_lease(s, toks(1000 * i, 2))
        assert len(got) == 2 and all(torch.equal(x, y) for x, y in zip(got, written[i]))
        s.check_integrity()
    disk.check_integrity()
    disk.close()


def test_slab_evictions_reach_the_index_and_a_new_tier_serves_the_rest(tmp_path: Path) -> None:
    disk = slab(tmp_path, 4)
    s = make_store(gpu_blocks=8, host_blocks=None, disk=disk, write="write_through")
    written = {i: prefill(s, toks(1000 * i, 2), seed=i) for i in range(3)}  # 6 blocks into 4 slots
    s.flush()
    s.drain_events()
    assert disk.stats().num_blocks == 4 and disk.stats().evictions == 2
    assert s.lookup(toks(0, 2)).tiers == ("gpu", "gpu")
    s.check_integrity()
    disk.close()
    again = slab(tmp_path, 4)
    reader = make_store(gpu_blocks=8, host_blocks=None, disk=again)
    assert reader.lookup(toks(0, 2)).tiers == ()  # evicted from the slab (the oldest), known by nobody
    for i in (1, 2):
        assert reader.lookup(toks(1000 * i, 2)).tiers == ("disk", "disk")
        got, _ = read_lease(reader, toks(1000 * i, 2))
        assert all(torch.equal(x, y) for x, y in zip(got, written[i]))
    reader.check_integrity()
    again.close()
