"""CostPolicy: uncached blocks weighted by tier plus load; ties broken by in-flight requests, then name."""

from __future__ import annotations

import pytest

from kvstore.route.index import PrefixHit
from kvstore.route.policy import CostPolicy, NoReplicaError, ReplicaLoad


def test_cost_is_missing_blocks_plus_tier_weighted_hits_plus_load() -> None:
    p = CostPolicy(block_weight=2.0, request_weight=0.5, token_weight=0.01,
                   tier_weights={"gpu": 0.0, "host": 0.25, "disk": 0.5, "remote": 0.75})
    hit = PrefixHit(6, {"gpu": 2, "host": 2, "disk": 1, "remote": 1})
    # 4 missing + 0.5 + 0.5 + 0.75 = 5.75 blocks; x2 = 11.5; + 3 requests x 0.5 + 100 tokens x 0.01
    assert p.cost(10, hit, ReplicaLoad(3, 100)) == pytest.approx(11.5 + 1.5 + 1.0)


def test_the_cached_replica_wins_until_its_load_outweighs_the_hit() -> None:
    p = CostPolicy(block_weight=1.0, token_weight=1 / 16)
    hits = {"a": PrefixHit(8, {"gpu": 8}), "b": PrefixHit(0, {})}
    assert p.choose(10, hits, {"a": ReplicaLoad(1, 100), "b": ReplicaLoad(0, 0)}).replica == "a"
    d = p.choose(10, hits, {"a": ReplicaLoad(4, 200), "b": ReplicaLoad(0, 0)})  # 2 + 12.5 > 10
    assert d.replica == "b"
    assert d.costs == {"a": pytest.approx(14.5), "b": pytest.approx(10.0)}
    assert d.hit == PrefixHit(0, {})


def test_ties_go_to_fewest_in_flight_then_name() -> None:
    p = CostPolicy(token_weight=0.0)
    loads = {"c": ReplicaLoad(2, 0), "b": ReplicaLoad(1, 0), "a": ReplicaLoad(1, 0)}
    assert p.choose(4, {}, loads).replica == "a"
    loads["a"].in_flight_requests = 3
    assert p.choose(4, {}, loads).replica == "b"


def test_idle_ties_send_a_new_prefix_to_the_emptiest_cache() -> None:
    """One request at a time, every replica idle: without the cache term every new conversation went to "a"."""
    p = CostPolicy()
    loads = {"a": ReplicaLoad(), "b": ReplicaLoad()}
    assert p.choose(4, {}, loads, held={"a": 12, "b": 0}).replica == "b"
    assert p.choose(4, {}, loads, held={"a": 12, "b": 30}).replica == "a"
    assert p.choose(4, {"b": PrefixHit(4, {"gpu": 4})}, loads, held={"a": 0, "b": 30}).replica == "b"  # a hit wins


def test_down_replicas_are_skipped_and_none_up_is_an_error() -> None:
    p = CostPolicy()
    hits = {"a": PrefixHit(4, {"gpu": 4})}
    loads = {"a": ReplicaLoad(up=False), "b": ReplicaLoad()}
    d = p.choose(4, hits, loads)
    assert d.replica == "b" and set(d.costs) == {"b"}
    with pytest.raises(NoReplicaError, match=r"no replica is up \(known: a, b\)"):
        p.choose(4, hits, {"a": ReplicaLoad(up=False), "b": ReplicaLoad(up=False)})


def test_for_block_size_puts_both_terms_in_prompt_tokens() -> None:
    p = CostPolicy.for_block_size(512, load_weight=0.5)
    # 2 blocks to compute = 1024 tokens' worth = 2.0; 1024 queued tokens at half weight = 1.0
    assert p.cost(2, PrefixHit(0, {}), ReplicaLoad(0, 1024)) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="load_weight >= 0"):
        CostPolicy.for_block_size(16, load_weight=-1)


def test_a_replica_with_larger_blocks_is_weighed_in_the_policys_unit() -> None:
    p = CostPolicy()
    hits = {"k": PrefixHit(2, {"gpu": 2}), "v": PrefixHit(2, {"gpu": 1, "host": 1})}  # v: 2 blocks of 32 tokens
    d = p.choose(6, hits, {"k": ReplicaLoad(0, 0), "v": ReplicaLoad(0, 0)}, {"v": 2.0})
    assert d.replica == "v" and d.costs == {"k": 4.0, "v": pytest.approx(2.0 + 0.05 * 2)}
    assert p.cost(3, PrefixHit(4, {"gpu": 4}), ReplicaLoad(0, 0), scale=1.5) == 0.0  # a hit past the prompt: no miss
