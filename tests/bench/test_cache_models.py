"""Exact behaviour of the hit-rate models: kvstore's tiered replay (every host and disk order, carried counts,
exclusive tiers), its agreement with the real host tier, and Belady's optimum."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.bench.belady import belady_hits
from kvstore.bench.cache_sim import HitCounts, SimTier, TieredCacheSim
from kvstore.bench.workloads import Request, synthetic
from kvstore.layout import KVLayout
from kvstore.policy.duel import DuelIndex
from kvstore.policy.order import make_order
from kvstore.policy.gdsf import DAMPED, WEIGHTS, GDSFIndex
from kvstore.tiers.host.tier import HostTier
from kvstore.policy.lru import LRUIndex
from kvstore.policy.s3fifo import S3FIFOIndex

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, model_id="sim-agreement")


def _reqs(*chains: list[int]) -> list[Request]:
    return [Request(np.asarray(c, dtype=np.int64), 16 * len(c)) for c in chains]


def _ids(tier: SimTier) -> list[int]:
    """Block ids of a simulated tier in its order's iteration order (LRU: least recent first)."""
    return [int.from_bytes(k, "little") for k in tier.order]


def test_gpu_only_lru_evicts_least_recent_leaf() -> None:
    sim = TieredCacheSim(gpu_blocks=4)
    hits = []
    for r in _reqs([1, 2], [3, 4], [1, 2], [5, 6], [3, 4], [1, 2]):
        hits.append(sim.request(r).total)
        sim.index.check_integrity()
        assert len(sim.index) + len(sim.free_gpu) == 4
    assert hits == [0, 0, 2, 0, 0, 0]  # [3,4] went for [5,6]; then [1,2] went for [3,4]


def test_tiered_demotes_to_host_then_disk_and_promotes_on_hit() -> None:
    sim = TieredCacheSim(gpu_blocks=2, host_blocks=2, disk_blocks=4)
    r12, r34, r56 = _reqs([1, 2], [3, 4], [5, 6])
    assert sim.request(r12) == HitCounts(0, 0, 0)
    assert sim.request(r34) == HitCounts(0, 0, 0)  # [1,2] spilled to host, tail first (2 is older)
    assert _ids(sim.host) == [2, 1]
    assert sim.request(r56) == HitCounts(0, 0, 0)  # [3,4] to host pushes 2, then 1, to disk
    assert _ids(sim.host) == [4, 3] and _ids(sim.disk) == [2, 1]
    assert sim.request(r12) == HitCounts(0, 0, 2)  # found on disk, promoted through host
    # promoting 1, 2 pushed 3, 4 from host to disk; evicting [5,6] from the GPU filled host again
    assert _ids(sim.host) == [6, 5] and sorted(_ids(sim.disk)) == [1, 2, 3, 4]
    assert sim.request(r34) == HitCounts(0, 0, 2)
    sim.index.check_integrity()


def test_tiered_matches_across_tiers_in_prefix_order() -> None:
    sim = TieredCacheSim(gpu_blocks=3, host_blocks=8)
    a, b, a_longer = _reqs([1, 2, 3], [7, 8, 9], [1, 2, 3, 4])
    sim.request(a)
    sim.request(b)  # a is demoted to host
    assert sim.request(a_longer) == HitCounts(0, 3, 0)


def test_belady_bypasses_the_block_needed_last() -> None:
    hits = belady_hits(_reqs([1], [2], [3], [1], [2]), capacity_blocks=2)
    assert hits == [0, 0, 0, 1, 1]


def test_belady_keeps_prefixes_closed() -> None:
    assert belady_hits(_reqs([1, 2], [1, 3], [1, 2]), capacity_blocks=2) == [0, 1, 2]
    assert belady_hits(_reqs([1, 2], [1, 2]), capacity_blocks=1) == [0, 1]  # the deeper block goes first


def test_tiers_use_the_real_order_classes() -> None:
    sim = TieredCacheSim(2, 2, 4, disk_policy="s3fifo")
    assert isinstance(sim.host.order, LRUIndex) and isinstance(sim.disk.order, S3FIFOIndex)
    assert isinstance(TieredCacheSim(2, 2, 4).disk.order, LRUIndex)
    assert isinstance(TieredCacheSim(2, 2, 4, disk_policy="gdsf").disk.order, GDSFIndex)


@pytest.mark.parametrize(("policy", "kept"), [("lru", False), ("s3fifo", True), ("gdsf", True)])
def test_disk_block_hit_once_survives_a_scan_only_under_s3fifo_and_gdsf(policy: str, kept: bool) -> None:
    sim = TieredCacheSim(gpu_blocks=1, host_blocks=1, disk_blocks=10, disk_policy=policy)
    for r in _reqs([1], [2], [3]):  # 1 reaches disk
        sim.request(r)
    assert sim.request(_reqs([1])[0]) == HitCounts(0, 0, 1)  # a disk hit: frequency 1 under S3-FIFO
    for r in _reqs(*([b] for b in range(100, 112))):  # a scan of one-time blocks through the disk
        sim.request(r)
    assert (sim.request(_reqs([1])[0]).disk == 1) is kept


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "gdsf"])
def test_belady_bounds_every_policy_on_a_workload(policy: str) -> None:
    trace = synthetic("zipf", quick=True, seed=3)
    gpu = max(len(r.blocks) for r in trace.requests)
    tiered = TieredCacheSim(gpu, 2 * gpu, 4 * gpu, disk_policy=policy)
    lru = TieredCacheSim(gpu)
    t = sum(tiered.request(r).total for r in trace.requests)
    g = sum(lru.request(r).total for r in trace.requests)
    opt = sum(belady_hits(trace.requests, 7 * gpu))
    inf = sum(belady_hits(trace.requests, trace.footprint_blocks))
    assert g <= t <= opt <= inf


def _counts(tier: SimTier, ids: list[int]) -> list[int | None]:
    order = tier.order
    assert isinstance(order, GDSFIndex)
    return [order.count_of(i.to_bytes(8, "little")) for i in ids]


@pytest.mark.parametrize("carry", [False, True])
def test_carried_use_count_seeds_host_then_disk(carry: bool) -> None:
    sim = TieredCacheSim(2, 2, 4, disk_policy="gdsf", host_policy="gdsf", carry_uses=carry)
    assert isinstance(sim.host.order, GDSFIndex)
    r12, r34, r56 = _reqs([1, 2], [3, 4], [5, 6])
    for r in (r12, r12, r12):  # inserted, then two GPU hits: 3 uses
        sim.request(r)
    sim.request(r34)  # [1,2] to host
    assert _counts(sim.host, [1, 2]) == ([3, 3] if carry else [1, 1])
    sim.request(r56)  # [3,4] to host push [1,2] to disk
    assert _counts(sim.host, [3, 4]) == [1, 1] and _counts(sim.disk, [1, 2]) == ([3, 3] if carry else [1, 1])
    assert sim.request(r12) == HitCounts(0, 0, 2)  # a disk hit: a use in the disk's own count too
    assert _counts(sim.disk, [1, 2]) == ([4, 4] if carry else [2, 2])
    if carry:
        assert sim.uses[(1).to_bytes(8, "little")] == 4 and len(sim.uses) == 6


def test_exclusive_tiers_hold_each_block_once() -> None:
    sim = TieredCacheSim(gpu_blocks=2, host_blocks=2, disk_blocks=4, exclusive=True)
    r12, r34, r56 = _reqs([1, 2], [3, 4], [5, 6])
    for r in (r12, r34, r56):  # [1,2] to host, then on to disk under [3,4]
        assert sim.request(r) == HitCounts(0, 0, 0)
    assert _ids(sim.host) == [4, 3] and _ids(sim.disk) == [2, 1]
    assert sim.request(r12) == HitCounts(0, 0, 2)  # loaded from disk, not copied into host; its disk copy stays
    assert _ids(sim.host) == [6, 5] and _ids(sim.disk) == [2, 1, 4, 3]  # [5,6] demoted to host pushed [3,4] down
    assert sim.request(r56) == HitCounts(0, 2, 0)  # [5,6] leave host for the GPU; [1,2] leave the GPU and are
    assert _ids(sim.host) == [] and _ids(sim.disk) == [2, 1, 4, 3]  # freed, not copied: the disk holds them
    sim.index.check_integrity()


def test_inclusive_tiers_keep_the_lower_copies() -> None:
    sim = TieredCacheSim(gpu_blocks=2, host_blocks=4, disk_blocks=4)
    r12, r34 = _reqs([1, 2], [3, 4])
    for r in (r12, r34):
        sim.request(r)
    assert sim.request(r12) == HitCounts(0, 2, 0)
    assert sorted(_ids(sim.host)) == [1, 2, 3, 4]  # [1,2] still there beside their GPU copies


@settings(max_examples=30, deadline=None)
@given(policy=st.sampled_from(["lru", "s3fifo", "gdsf"]), weight=st.sampled_from(sorted(WEIGHTS)),
       ops=st.lists(st.tuples(st.sampled_from(["put", "get", "seed"]), st.integers(0, 11), st.integers(1, 12)),
                    min_size=1, max_size=60))
def test_simulated_host_keeps_what_the_real_host_tier_keeps(policy: str, weight: str,
                                                            ops: list[tuple[str, int, int]]) -> None:
    """The simulator's host (``SimTier``) and a real ``HostTier`` under one order (GDSF with either count weight,
    as the placement policies build them), fed the same puts, hits and seeded counts,
    hold the same blocks after every step and give up the same victims."""
    slots = 4
    real = HostTier(LAYOUT, slots * LAYOUT.bytes_per_block, pin_memory="never",
                    order=make_order(policy, WEIGHTS[weight]))
    sim = SimTier(slots, policy, WEIGHTS[weight])
    block = torch.zeros(LAYOUT.bytes_per_block, dtype=torch.uint8)
    try:
        for op, i, n in ops:
            key = i.to_bytes(8, "little")
            if op == "put" and key not in sim:
                assert real.put([key], [block]) == [True]
                sim.add(key)
            elif op == "get":
                assert real.get([key], [torch.empty_like(block)]) == [key in sim]
                sim.touch(key)
            elif op == "seed":
                real.seed_uses([key], [n])
                sim.order.seed(key, n)
            assert {k for k in (j.to_bytes(8, "little") for j in range(12)) if real.contains(k)} == set(sim.order)
            real.check_integrity()
        assert real.victims(slots) == sim.order.victims(slots, len(sim.order))
    finally:
        real.close()


def test_use_memory_resumes_the_count_of_a_block_dropped_from_every_tier() -> None:
    """``policy.use_memory`` in the replay: the store's ``UseMemory``, 2 x (2 host + 0 disk) = 4 blocks of it."""
    sim = TieredCacheSim(2, 2, 0, host_policy="gdsf", carry_uses=True, use_memory=2)
    assert sim.memory is not None and sim.memory.capacity == 4
    r12, r34, r56 = _reqs([1, 2], [3, 4], [5, 6])
    for r in (r12, r12, r12, r34, r56):  # 3 uses of [1,2]; then it goes to host and out of it, with no disk below
        sim.request(r)
    key = (1).to_bytes(8, "little")
    assert key not in sim.uses and sim.memory.uses_of(key) == 3
    assert sim.request(r12) == HitCounts(0, 0, 0)  # recomputed: [5,6] to host pushes [3,4] out of every tier
    assert sim.uses[key] == 4 and key not in sim.memory  # resumed: 3 + this insert
    assert [sim.memory.uses_of(i.to_bytes(8, "little")) for i in (3, 4)] == [1, 1]
    sim.request(r34)  # [3,4] resumes too, and [1,2] enters host with its 4 uses
    assert _counts(sim.host, [1, 2]) == [4, 4]
    with pytest.raises(ValueError, match="use_memory needs carry_uses"):
        TieredCacheSim(2, 2, 0, use_memory=2)


def test_shared_duel_below_the_gpu_is_one_referee_scoring_host_and_disk_hits() -> None:
    """``policy.duel_scope: below_gpu`` in the replay: ``shared_duel``'s two orders, one referee, fed the hits of
    both tiers (the tier-scope duel on disk sees only disk hits)."""
    shared = TieredCacheSim(1, 2, 2, host_policy="duel", disk_policy="duel", duel_scope="below_gpu",
                            carry_uses=True, exclusive=True)
    alone = TieredCacheSim(1, 2, 2, disk_policy="duel", carry_uses=True, exclusive=True)
    assert isinstance(shared.host.order, DuelIndex) and isinstance(shared.disk.order, DuelIndex)
    assert shared.host.order.referee is shared.disk.order.referee and shared.host.order.referee.levels == 2
    sampled = [i for i in range(200) if shared.host.order.referee.sampled(i.to_bytes(8, "little"))][:2]
    a, b = sampled
    for sim in (shared, alone):  # the GPU holds one block: the other is found on host
        assert [sim.request(r) for r in _reqs([a], [b], [a], [b])] == [HitCounts(0, 0, 0)] * 2 + [HitCounts(0, 1, 0)] * 2
    assert shared.host.order.scores == [2.0, 2.0, 2.0]  # the two host hits, in every miniature
    assert isinstance(alone.disk.order, DuelIndex) and sum(alone.disk.order.scores) == 0  # no disk hit: no score
    with pytest.raises(ValueError, match="needs host_policy and disk_policy 'duel'"):
        TieredCacheSim(1, 2, 2, disk_policy="duel", duel_scope="below_gpu")
    with pytest.raises(ValueError, match="duel_scope must be"):
        TieredCacheSim(1, 2, 2, duel_scope="pair")


def test_gdsf_weight_builds_the_replay_s_gdsf_orders_with_it() -> None:
    """``policy.gdsf_weight`` in the replay: the host and disk GDSF orders (and a shared duel's) get the weight."""
    sim = TieredCacheSim(2, 2, 4, host_policy="gdsf", disk_policy="gdsf", carry_uses=True, gdsf_weight="damped")
    assert isinstance(sim.host.order, GDSFIndex) and isinstance(sim.disk.order, GDSFIndex)
    assert sim.host.order.weight == sim.disk.order.weight == DAMPED
    shared = TieredCacheSim(1, 2, 2, host_policy="duel", disk_policy="duel", duel_scope="below_gpu", carry_uses=True,
                            exclusive=True, gdsf_weight="damped")
    assert isinstance(shared.host.order, DuelIndex) and shared.host.order.referee.weight == DAMPED
    assert isinstance(TieredCacheSim(2, 2, 4, disk_policy="gdsf").disk.order, GDSFIndex)
    with pytest.raises(ValueError, match="gdsf_weight must be one of"):
        TieredCacheSim(2, 2, 4, gdsf_weight="log")
