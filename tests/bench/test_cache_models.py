"""Exact behaviour of the hit-rate models: kvstore's tiered LRU replay and Belady's optimum."""

from __future__ import annotations

import numpy as np

from kvstore.bench.belady import belady_hits
from kvstore.bench.cache_sim import HitCounts, TieredCacheSim
from kvstore.bench.workloads import Request, synthetic


def _reqs(*chains: list[int]) -> list[Request]:
    return [Request(np.asarray(c, dtype=np.int64), 16 * len(c)) for c in chains]


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
    assert sim.request(r34) == HitCounts(0, 0, 0)  # [1,2] spilled to host
    assert list(sim.host.blocks) == [1, 2]
    assert sim.request(r56) == HitCounts(0, 0, 0)  # [3,4] to host pushes 1, 2 to disk
    assert list(sim.host.blocks) == [3, 4] and list(sim.disk.blocks) == [1, 2]
    assert sim.request(r12) == HitCounts(0, 0, 2)  # found on disk, promoted through host
    # promoting 1, 2 pushed 3, 4 from host to disk; evicting [5,6] from the GPU filled host again
    assert list(sim.host.blocks) == [5, 6] and sorted(sim.disk.blocks) == [1, 2, 3, 4]
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


def test_belady_bounds_both_policies_on_a_workload() -> None:
    trace = synthetic("zipf", quick=True, seed=3)
    gpu = max(len(r.blocks) for r in trace.requests)
    tiered = TieredCacheSim(gpu, 2 * gpu, 4 * gpu)
    lru = TieredCacheSim(gpu)
    t = sum(tiered.request(r).total for r in trace.requests)
    g = sum(lru.request(r).total for r in trace.requests)
    opt = sum(belady_hits(trace.requests, 7 * gpu))
    inf = sum(belady_hits(trace.requests, trace.footprint_blocks))
    assert g <= t <= opt <= inf
