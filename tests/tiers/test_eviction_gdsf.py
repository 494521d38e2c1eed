"""GDSF order: exact victims on hand-made sequences (count, aging through ``L``, ties by oldest use,
a prefix's tail before its head), what ``victims`` may change, and the count weights (``policy.gdsf_weight``)."""

from __future__ import annotations

import pytest

from kvstore.policy.order import make_order
from kvstore.policy.gdsf import DAMPED, LINEAR, WEIGHTS, CountWeight, GDSFIndex


def _k(i: int) -> bytes:
    return i.to_bytes(4, "little")


def _evict(order: GDSFIndex, need: int, budget: int) -> list[int]:
    out = order.victims(need, budget)
    for key in out:
        order.remove(key)
    return [int.from_bytes(k, "little") for k in out]


def test_registered_by_name() -> None:
    assert isinstance(make_order("gdsf"), GDSFIndex)


def test_fewest_uses_go_first_then_oldest_use() -> None:
    order = GDSFIndex()
    for i in range(4):
        order.add(_k(i), 1)
    order.touch(_k(0))
    order.touch(_k(0))
    order.touch(_k(2))
    assert [order.count_of(_k(i)) for i in range(4)] == [3, 1, 2, 1]
    assert [int.from_bytes(k, "little") for k in order] == [1, 3, 2, 0]
    assert _evict(order, 1, 4) == [1]  # count 1, used before 3
    assert order.inflation == 1.0
    assert _evict(order, 3, 4) == [3, 2]


def test_inflation_ages_out_a_block_used_often_long_ago() -> None:
    order = GDSFIndex()
    order.add(_k(0), 1)
    for _ in range(2):
        order.touch(_k(0))  # priority 0 + 3 = 3
    nxt = 1
    gone: list[int] = []
    while 0 not in gone:  # a stream of blocks used twice each, two at a time
        for k in (nxt, nxt + 1):
            gone += _evict(order, 1, 3)
            order.add(_k(k), 1)
            order.touch(_k(k))  # priority L + 2
        nxt += 2
    # 1 and 2 (priority 2) go before 0 (3); they raise L to 2, so 3 and 4 enter at 4 and 0 goes next;
    # the round's second eviction then takes 3 (priority 4, the older use of 3 and 4)
    assert gone == [1, 2, 0, 3]
    assert order.inflation == 4.0


def test_a_prefix_touched_deepest_first_loses_its_tail_first() -> None:
    order = GDSFIndex()
    chain = [_k(i) for i in range(4)]
    for key in chain:
        order.add(key, 1)
    for key in reversed(chain):  # how the tiers record a hit on a prefix
        order.touch(key)
    assert _evict(order, 2, 4) == [3, 2]


def test_new_blocks_enter_at_inflation_plus_one() -> None:
    order = GDSFIndex()
    order.add(_k(0), 1)
    order.touch(_k(0))
    order.add(_k(1), 1)
    order.touch(_k(1))
    order.touch(_k(1))
    assert _evict(order, 1, 2) == [0] and order.inflation == 2.0
    order.add(_k(2), 1)
    assert order.priority_of(_k(2)) == 3.0 and order.priority_of(_k(1)) == 3.0
    assert _evict(order, 1, 2) == [1]  # equal priority: the older use goes


def test_victims_only_raise_inflation_and_excluded_keys_stay() -> None:
    order = GDSFIndex()
    for i in range(3):
        order.add(_k(i), 2)
    before = (list(order), order.used, [order.priority_of(_k(i)) for i in range(3)])
    assert order.victims(2, 6, exclude=[_k(0)]) == [_k(1)]
    assert (list(order), order.used, [order.priority_of(_k(i)) for i in range(3)]) == before
    assert order.inflation == 1.0
    assert order.victims(0, 6) == [] and order.inflation == 1.0


def test_add_of_a_resident_key_keeps_its_count() -> None:
    order = GDSFIndex()
    order.add(_k(0), 5)
    order.touch(_k(0))
    order.add(_k(0), 7)
    assert order.count_of(_k(0)) == 2 and order.used == 7 and order.size_of(_k(0)) == 7


def test_add_oldest_goes_before_every_used_key() -> None:
    order = GDSFIndex()
    order.add(_k(9), 1)
    order.add_oldest(_k(1), 1)
    order.add_oldest(_k(0), 1)
    assert [int.from_bytes(k, "little") for k in order] == [0, 1, 9]
    assert order.oldest(2) == [_k(0), _k(1)]


def test_stale_heap_entries_are_compacted() -> None:
    order = GDSFIndex()
    order.add(_k(0), 1)
    order.add(_k(1), 1)
    for _ in range(1000):
        order.touch(_k(0))
    assert len(order._heap) <= 2 * len(order) + 65
    assert _evict(order, 1, 2) == [1]


def test_count_weights_linear_and_damped() -> None:
    assert [LINEAR(c) for c in (1, 2, 9)] == [1.0, 2.0, 9.0]
    assert [round(DAMPED(c), 4) for c in (1, 2, 8, 9, 100)] == [1.0, 1.7411, 5.278, 5.278, 5.278]
    assert WEIGHTS == {"linear": LINEAR, "damped": DAMPED} and GDSFIndex().weight == LINEAR
    for power, cap in ((0.0, 0), (1.5, 0), (0.8, -1)):
        with pytest.raises(ValueError, match="0 < power <= 1"):
            CountWeight(power, cap)


def test_a_damped_order_weighs_counts_less_and_caps_them() -> None:
    """Priority ``L + w(count)``: the count is kept whole, only the priority is damped; beyond the cap more uses
    buy nothing, so between counts 8 and 9 the older use goes first."""
    order = make_order("gdsf", DAMPED)
    assert isinstance(order, GDSFIndex) and order.weight == DAMPED
    for key, uses in ((_k(0), 9), (_k(1), 8), (_k(2), 2)):
        order.add(key, 1)
        order.seed(key, uses)
    assert [order.count_of(_k(i)) for i in range(3)] == [9, 8, 2]
    assert order.priority_of(_k(0)) == order.priority_of(_k(1)) == DAMPED(8)
    assert _evict(order, 2, 3) == [2, 0]  # count 2 first; then 9 and 8 tie, and 9 was seeded first
    assert order.inflation == DAMPED(8)
    order.add(_k(3), 1)
    assert order.priority_of(_k(3)) == DAMPED(8) + 1  # a new block enters at L + w(1)
    linear = GDSFIndex()
    for key, uses in ((_k(0), 9), (_k(1), 8)):
        linear.add(key, 1)
        linear.seed(key, uses)
    assert _evict(linear, 1, 2) == [1]  # linear: 9 uses outrank 8
