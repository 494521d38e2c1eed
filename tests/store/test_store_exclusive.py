"""Exclusive tiers (``policy.placement: adaptive`` under ``policy.write: write_back``, the default configuration,
and variants): host and disk hold distinct blocks, and host none the GPU holds. A load moves a block up (its
host copy goes; a disk copy stays, it may have been acknowledged as durable), an eviction moves it down
(GPU -> host -> disk; a GPU victim the disk holds is only freed), and every load returns the bytes stored.
A flush writes every block only the GPU or the host holds to the disk, and what it acknowledged is on disk
after a restart, also once it was loaded again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.config.schema import PolicyConfig
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.policy.named import POLICIES, PlacementPolicy
from kvstore.store.tiered import TieredStore
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
    """(on GPU, in the host tier, in the disk tier) per block, asked of the tiers themselves (after the
    scheduled write-downs; no flush, which would write every block down)."""
    s.spiller.wait()
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
        data, _ = read_lease(s, a)  # disk -> GPU, no host copy; the disk copy stays
        assert all(torch.equal(d, w) for d, w in zip(data, stored))
        assert s.h.counters.loaded_blocks["disk"] == loaded_before + 2
        assert _where(s, a) == [(True, False, True)] * 2
        s.check_integrity()
        for start in (600, 700):  # a leaves the GPU again: the disk has it, so it is freed, not copied into host
            truth[start] = prefill(s, _toks(start, 2), seed=start)
        assert _where(s, a) == [(False, False, True)] * 2
        for start, written in truth.items():  # every other prompt: never in both host and disk, bytes intact
            assert all(sum(w) == 1 for w in _where(s, _toks(start, 2))), start
            data, _ = read_lease(s, _toks(start, 2))
            assert len(data) == 2 and all(torch.equal(d, w) for d, w in zip(data, written)), start
            assert all(gpu and not host for gpu, host, _ in _where(s, _toks(start, 2))), start
            s.check_integrity()
    finally:
        s.close()


def test_the_default_configuration_has_exclusive_tiers() -> None:
    """As shipped (no policy set): ``write_back`` under ``adaptive``, so host and disk hold distinct blocks."""
    policy = PolicyConfig()
    assert policy.write == "write_back" and policy.placement == "adaptive"
    s = TieredStore(LAYOUT, GPUBlockPool(LAYOUT, 4, device="cpu"), None, None)
    try:
        assert s.h.exclusive
    finally:
        s.close()


def test_a_flush_writes_every_block_down_and_what_it_acknowledged_stays_on_disk(tmp_path: Path) -> None:
    """Under the default write policy blocks reach the disk only when they leave host, so a flush writes down
    those only the GPU or the host holds; a flushed block loaded back to the GPU keeps its disk copy, and a
    new store on the same directory (no close: as after a crash) serves every flushed block bit for bit."""
    s = _store(tmp_path, "duel", True)
    a, b = _toks(0, 2), _toks(100, 2)
    stored_a = prefill(s, a, seed=1)
    stored_b = prefill(s, b, seed=2)
    truth = {start: prefill(s, _toks(start, 2), seed=start) for start in (200,)}  # a: GPU -> host
    assert _where(s, a) == [(False, True, False)] * 2 and _where(s, b) == [(True, False, False)] * 2
    s.flush()
    assert _where(s, a) == [(False, True, True)] * 2  # host-only, now also on disk
    assert _where(s, b) == [(True, False, True)] * 2  # GPU-only, written straight to disk (not through host)
    assert _where(s, _toks(200, 2)) == [(True, False, True)] * 2
    data, _ = read_lease(s, a)  # host -> GPU: the host copy goes, the acknowledged disk copy stays
    assert all(torch.equal(d, w) for d, w in zip(data, stored_a))
    assert _where(s, a) == [(True, False, True)] * 2
    s.check_integrity()
    s.spiller.close()  # no flush, no close of the tiers: the disk holds what the flush acknowledged
    assert s.h.disk is not None
    s.h.disk.close()
    disk = DiskTier(LAYOUT, tmp_path, 1 << 20, sync="interval")
    fresh = TieredStore(LAYOUT, GPUBlockPool(LAYOUT, 4, device="cpu"), None, disk, PolicyConfig())
    try:
        for toks, want in ((a, stored_a), (b, stored_b), (_toks(200, 2), truth[200])):
            data, _ = read_lease(fresh, toks)
            assert len(data) == 2 and all(torch.equal(d, w) for d, w in zip(data, want))
    finally:
        fresh.close()
