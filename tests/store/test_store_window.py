"""A reader whose every layer has a sliding window: blocks wholly before the first query's window are not read.

8 cached blocks of 4 tokens (32 tokens), a 6-token window: the first uncached query (token 32) reads keys
27-32, so only blocks 6 and 7 are loaded; blocks 0-5 hold GPU blocks that keep their place, never read,
never recorded as copies.
"""

from __future__ import annotations

import torch

from storelib import LAYOUT, MemoryTier, make_store, prefill

BS = LAYOUT.block_size
WINDOW = 6


def toks(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * BS))


def _disk_store(delay_s: float = 0.0, **policy: object):  # noqa: ANN202
    disk = MemoryTier(LAYOUT)
    writer = make_store(disk=disk, write="write_through")
    data = prefill(writer, toks(0, 8), seed=3)
    writer.flush()
    disk.delay_s = delay_s
    return make_store(gpu_blocks=16, host_blocks=16, disk=disk, **policy), disk, data


def test_only_the_blocks_inside_the_window_are_read_and_placeholders_are_never_copies() -> None:
    s, disk, data = _disk_store(prefetch="wait_complete")
    lease = s.acquire(s.lookup(toks(0, 8)), window=WINDOW)
    assert lease.resolve() == 8 * BS and lease.shortfall is None
    lease.wait()
    assert disk.gets == 2 and s.h.counters.loaded_blocks["disk"] == 2
    ids = lease.block_ids
    assert len(ids) == 8 and s.h.placeholders == set(ids[:6])
    for b, want in zip(ids[6:], data[6:]):
        assert torch.equal(s.pool.block(b), want)
    keys = s.keys(toks(0, 8))
    # The engine commits its whole block table: the placeholders record nothing.
    s.commit(keys, ids, toks(0, 8))
    assert [s.index.get(k).gpu_block is not None for k in keys] == [False] * 6 + [True] * 2
    s.release(lease)
    assert not s.h.placeholders
    s.check_integrity()
    # A full-attention reader (window 0) of the same prefix reads the six blocks it needs from disk.
    full = s.acquire(s.lookup(toks(0, 8)))
    assert full.resolve() == 8 * BS
    full.wait()
    assert disk.gets == 2 + 6
    for b, want in zip(full.block_ids, data):
        assert torch.equal(s.pool.block(b), want)
    s.release(full)
    s.check_integrity()


def test_a_prefix_cut_back_into_blocks_never_loaded_resolves_to_nothing() -> None:
    # Block 7's read fails after the lookup: the usable prefix is 7 blocks (28 tokens), whose first query's
    # window (keys 23-28) reaches block 5, which was never loaded. Nothing of the lease may be used.
    s, disk, _ = _disk_store(delay_s=0.05, prefetch="wait_complete")
    keys = s.keys(toks(0, 8))
    lease = s.acquire(s.lookup(toks(0, 8)), window=WINDOW)
    disk.delete([keys[7]])  # while phase 1 sleeps before reading
    assert lease.resolve() == 0
    assert "window" in (lease.shortfall or "") and lease.block_ids == []
    s.release(lease)
    assert not s.h.placeholders
    s.check_integrity()
