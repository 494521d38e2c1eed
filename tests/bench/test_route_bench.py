"""``kvstore bench route``'s replay: exact routing behaviour on small hand-made traces (no timing asserted)."""

from __future__ import annotations

import numpy as np

from kvstore.bench.route import _router
from kvstore.bench.route_replay import replay
from kvstore.bench.route_sim import ReplicaModel
from kvstore.bench.workloads import Request

BT = 512
MODEL = ReplicaModel(gpu_blocks=100, host_blocks=0, block_tokens=BT)


def _req(ids: list[int]) -> Request:
    return Request(np.asarray(ids, dtype=np.int64), len(ids) * BT + 7)


def _conversations() -> tuple[list[Request], list[float]]:
    """Two chats of three turns, each turn the previous prompt plus two blocks, turns 10 s apart."""
    reqs, times = [], []
    for turn in range(3):
        for c, base in enumerate((100, 200)):
            reqs.append(_req(list(range(base, base + 2 * (turn + 1)))))
            times.append(10.0 * turn + 0.01 * c)
    return reqs, times


def test_kvstore_sends_each_later_turn_to_the_replica_holding_its_history() -> None:
    reqs, times = _conversations()
    names = ["r0", "r1", "r2"]
    kv = replay(reqs, times, [10] * 6, names, MODEL, _router("kvstore", MODEL))
    # turn 2 hits 2 blocks, turn 3 hits 4, for both chats
    assert kv.hit_tokens == (2 + 2 + 4 + 4) * BT
    assert kv.prompt_tokens == sum(r.prompt_tokens for r in reqs)
    rr = replay(reqs, times, [10] * 6, names, MODEL, _router("round_robin", MODEL))
    assert rr.hit_tokens == 0  # r0, r1, r2, r0, r1, r2: no turn meets its history
    assert rr.requests_per_replica == {"r0": 2, "r1": 2, "r2": 2}
    assert kv.ttft_s.mean() < rr.ttft_s.mean()  # the same model: cached tokens are not recomputed


def test_exact_prefix_alone_collapses_onto_one_replica_and_the_load_term_spreads() -> None:
    shared = list(range(1, 9))
    reqs = [_req(shared + [1000 + i]) for i in range(40)]
    times = [0.6 + 0.03 * i for i in range(40)]
    reqs.insert(0, _req(shared))  # the shared prefix is cached on r0 first
    times.insert(0, 0.0)
    names = ["r0", "r1", "r2", "r3"]
    prefix_only = replay(reqs, times, [10] * 41, names, MODEL, _router("exact_prefix", MODEL))
    assert prefix_only.requests_per_replica == {"r0": 41, "r1": 0, "r2": 0, "r3": 0}
    kv = replay(reqs, times, [10] * 41, names, MODEL, _router("kvstore_ttft_greedy", MODEL))
    assert all(n > 0 for n in kv.requests_per_replica.values())
    assert kv.ttft_s.mean() < prefix_only.ttft_s.mean()


def test_approx_tree_follows_its_own_routing_history() -> None:
    reqs, times = _conversations()
    res = replay(reqs, times, [10] * 6, ["r0", "r1", "r2"], MODEL, _router("approx_tree", MODEL))
    # new chats go to the smallest tree (r0, then r1); later turns match their chat's tree above 30 %
    assert res.requests_per_replica == {"r0": 3, "r1": 3, "r2": 0}
    assert res.hit_tokens == (2 + 2 + 4 + 4) * BT
