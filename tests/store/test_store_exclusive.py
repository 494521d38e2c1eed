"""Exclusive tiers (``policy.placement: adaptive`` under ``policy.write: write_back``, and variants): each block
lives in one of GPU, host and disk. A load moves a block up (its host
and disk copies go), an eviction moves it down (GPU -> host -> disk), and every load returns the bytes stored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.config.schema import PolicyConfig
from kvstore.gpu_pool import GPUBlockPool
from kvstore.policy.named import POLICIES, PlacementPolicy
from kvstore.store import TieredStore
from kvstore.tiers.lmdb.tier import DiskTier
from kvstore.tiers.host.tier import HostTier
from storelib import LAYOUT, prefill, read_lease

BS = LAYOUT.block_size


def _toks(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * BS))


def _store(root: Path, eviction: str, carry: bool) -> TieredStore:
    """Exclusive tiers under ``eviction`` orders: ``adaptive`` (a named policy) or a variant of one."""
    pool = GPUBlockPool(LAYOUT, 4, device="cpu")
    policy = (POLICIES["adaptive"] if eviction == "duel" else
              PlacementPolicy("exclusive variant", eviction, carry_uses=carry, exclusive_when_write_back=True))  # type: ignore[arg-type]
    orders = policy.orders()
    host = HostTier(LAYOUT, 2 * LAYOUT.bytes_per_block, auto_evict=False, order=orders.host)
    disk = DiskTier(LAYOUT, root, 1 << 20, sync="interval", order=orders.disk)
    return TieredStore(LAYOUT, pool, host, disk, PolicyConfig(write="write_back"), placement=policy)


def _where(s: TieredStore, tokens: list[int]) -> list[tuple[bool, bool, bool]]:
    """(on GPU, in the host tier, in the disk tier) per block, asked of the tiers themselves."""
    s.flush()
    out = []
    for k in s.keys(tokens):
        e = s.index.get(k)
        assert s.h.host is not None and s.h.disk is not None
        out.append((e is not None and e.gpu_block is not None, s.h.host.contains(k), s.h.disk.contains(k)))
    return out


def test_adaptive_is_exclusive_only_under_write_back(tmp_path: Path) -> None:
    """Other write policies copy a block down before it leaves the GPU, so the tiers hold copies there."""
    adaptive = POLICIES["adaptive"]
    assert adaptive.exclusive("write_back")
    assert not adaptive.exclusive("write_through") and not adaptive.exclusive("write_through_selective")
    assert not any(p.exclusive("write_back") for p in POLICIES.values() if p.name != "adaptive")
    pool = GPUBlockPool(LAYOUT, 4, device="cpu")
    for write, exclusive in (("write_back", True), ("write_through", False)):
        s = TieredStore(LAYOUT, pool, None, None, PolicyConfig(write=write))  # type: ignore[arg-type]
        assert s.h.exclusive is exclusive  # adaptive is the default placement
        s.close()


@pytest.mark.parametrize(("eviction", "carry"), [("lru", False), ("gdsf", True), ("duel", True)])
def test_each_block_in_one_tier_and_loads_return_what_was_stored(tmp_path: Path, eviction: str, carry: bool) -> None:
    s = _store(tmp_path, eviction, carry)
    try:
        a = _toks(0, 2)
        stored = prefill(s, a, seed=1)
        truth = {start: prefill(s, _toks(start, 2), seed=start) for start in (100, 200)}  # a: GPU -> host
        assert _where(s, a) == [(False, True, False)] * 2
        data, _ = read_lease(s, a)  # host -> GPU: the host copy goes
        assert all(torch.equal(d, w) for d, w in zip(data, stored))
        assert _where(s, a) == [(True, False, False)] * 2
        for start in (300, 400, 500):  # a goes down again: GPU -> host (written back) -> disk
            truth[start] = prefill(s, _toks(start, 2), seed=start)
        assert _where(s, a) == [(False, False, True)] * 2
        loaded_before = s.h.counters.loaded_blocks["disk"]
        data, _ = read_lease(s, a)  # disk -> GPU, no host copy: the disk copy goes
        assert all(torch.equal(d, w) for d, w in zip(data, stored))
        assert s.h.counters.loaded_blocks["disk"] == loaded_before + 2
        assert _where(s, a) == [(True, False, False)] * 2
        s.check_integrity()
        for start, written in truth.items():  # every other prompt: in exactly one tier, and its bytes intact
            assert all(sum(w) == 1 for w in _where(s, _toks(start, 2))), start
            data, _ = read_lease(s, _toks(start, 2))
            assert len(data) == 2 and all(torch.equal(d, w) for d, w in zip(data, written)), start
            assert _where(s, _toks(start, 2)) == [(True, False, False)] * 2
            s.check_integrity()
    finally:
        s.close()
