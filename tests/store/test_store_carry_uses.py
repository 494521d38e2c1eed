"""Carried use counts (``policy.placement: gdsf`` and ``adaptive``): a block's use count lives in its index entry
and seeds the GDSF order of each tier it is demoted to (host, then disk), so a block used often keeps its
priority below the GPU; a GDSF variant that does not carry them starts every block at 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.config.schema import PolicyConfig
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.store.tiered import TieredStore
from kvstore.tiers.lmdb.tier import DiskTier
from kvstore.policy.gdsf import GDSFIndex
from kvstore.policy.named import POLICIES, PlacementPolicy
from kvstore.tiers.host.tier import HostTier
from storelib import LAYOUT, prefill, read_lease

BS = LAYOUT.block_size


def _toks(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * BS))


def _store(root: Path, carry: bool) -> TieredStore:
    pool = GPUBlockPool(LAYOUT, 4, device="cpu")
    policy = POLICIES["gdsf"] if carry else PlacementPolicy("gdsf without carried counts", "gdsf")
    orders = policy.orders()
    host = HostTier(LAYOUT, 2 * LAYOUT.bytes_per_block, auto_evict=False, order=orders.host)
    disk = DiskTier(LAYOUT, root, 1 << 20, sync="interval", order=orders.disk)
    return TieredStore(LAYOUT, pool, host, disk, PolicyConfig(write="write_back"), placement=policy)


def _count(order: object, key: bytes) -> int | None:
    assert isinstance(order, GDSFIndex)
    return order.count_of(key)


@pytest.mark.parametrize("carry", [False, True])
def test_use_count_follows_a_block_down_to_host_then_disk(tmp_path: Path, carry: bool) -> None:
    s = _store(tmp_path, carry)
    try:
        a = _toks(0, 2)
        written = prefill(s, a, seed=1)
        s.lookup(a)
        s.lookup(a)  # two hits: each block of a has been used 3 times (insert + 2 lookups), counted when carried
        keys = s.keys(a)
        assert [s.index.get(k).hits for k in keys] == ([2, 2] if carry else [0, 0])  # type: ignore[union-attr]
        prefill(s, _toks(100, 2), seed=2)
        prefill(s, _toks(200, 2), seed=3)  # a leaves the GPU for host
        s.flush()
        host_order = s.h.host._order  # noqa: SLF001 - the order the host evicts by
        assert [_count(host_order, k) for k in keys] == ([3, 3] if carry else [1, 1])
        prefill(s, _toks(300, 2), seed=4)  # the second prompt goes to host and pushes a to disk
        s.flush()
        disk_order = s.h.disk._lru  # type: ignore[union-attr]  # noqa: SLF001
        assert [_count(disk_order, k) for k in keys] == ([3, 3] if carry else [1, 1])
        data, _ = read_lease(s, a)  # loaded back from disk: the bytes that were stored
        assert all(torch.equal(d, w) for d, w in zip(data, written))
        s.check_integrity()
    finally:
        s.close()
