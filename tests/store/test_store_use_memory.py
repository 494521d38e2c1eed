"""Remembered counts (``policy.placement: adaptive`` remembers 4x the capacity; here a variant with 2x): a block dropped from every tier leaves its use count in the store's ``UseMemory``,
and resumes it when it is indexed again, so its GDSF priority below the GPU survives the trip."""

from __future__ import annotations


import pytest

from kvstore.config.schema import PolicyConfig
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.policy.named import PlacementPolicy
from kvstore.store.tiered import TieredStore
from kvstore.tiers.host.tier import HostTier
from storelib import LAYOUT, prefill

BS = LAYOUT.block_size


def _toks(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * BS))


def _store(use_memory: float) -> TieredStore:
    pool = GPUBlockPool(LAYOUT, 2, device="cpu")
    policy = PlacementPolicy("gdsf remembering counts", "gdsf", carry_uses=True, use_memory=use_memory)
    host = HostTier(LAYOUT, 2 * LAYOUT.bytes_per_block, auto_evict=False, order=policy.orders(both_tiers=False).host)
    return TieredStore(LAYOUT, pool, host, None, PolicyConfig(write="write_back"), placement=policy)


@pytest.mark.parametrize("use_memory", [0.0, 2.0])
def test_a_dropped_block_resumes_its_count(use_memory: float) -> None:
    s = _store(use_memory)
    try:
        memory = s.h.use_memory
        assert (memory is None) if use_memory == 0 else (memory is not None and memory.capacity == 4)  # 2 x 2 slots
        a = _toks(0, 2)
        prefill(s, a, seed=1)
        s.lookup(a)
        s.lookup(a)  # 3 uses per block
        keys = s.keys(a)
        prefill(s, _toks(100, 2), seed=2)  # a: GPU -> host
        prefill(s, _toks(200, 2), seed=3)  # the second prompt takes host: a leaves every tier
        s.flush()
        assert all(s.index.get(k) is None for k in keys)
        if memory is not None:
            assert [memory.uses_of(k) for k in keys] == [3, 3]
        prefill(s, a, seed=1)  # recomputed (its GPU room sends the 100 prompt out of every tier too): indexed again
        assert [s.index.get(k).hits + 1 for k in keys] == ([4, 4] if memory is not None else [1, 1])  # type: ignore[union-attr]
        if memory is not None:
            assert all(k not in memory for k in keys)  # the count lives in the index entry again
            assert [memory.uses_of(k) for k in s.keys(_toks(100, 2))] == [1, 1] and len(memory) == 2
        s.check_integrity()
    finally:
        s.close()
