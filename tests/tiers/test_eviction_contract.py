"""The eviction-order interface, checked the same way for every order in the registry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.policy.order import ORDERS, EvictionOrder, make_order
from kvstore.policy.exclude import KeyFilter, skip_set
from kvstore.policy.lru import LRUIndex
from kvstore.policy.s3fifo import S3FIFOIndex

NAMES = sorted(ORDERS)


def _k(i: int) -> bytes:
    return i.to_bytes(4, "little")


def _check(order: EvictionOrder) -> None:
    keys = list(order)
    assert len(keys) == len(set(keys)) == len(order)
    assert all(k in order for k in keys)
    assert order.used == sum(order.size_of(k) or 0 for k in keys)


def test_registry_names_and_unknown_name() -> None:
    assert NAMES == ["duel", "gdsf", "lru", "s3fifo"]
    assert isinstance(make_order("lru"), LRUIndex) and isinstance(make_order("s3fifo"), S3FIFOIndex)
    assert make_order("lru") is not make_order("lru")
    with pytest.raises(ValueError, match="known: duel, gdsf, lru, s3fifo"):
        make_order("arc")


@pytest.mark.parametrize("name", NAMES)
def test_membership_sizes_and_removal(name: str) -> None:
    order = make_order(name)
    for i in range(5):
        order.add(_k(i), 10 + i)
    assert len(order) == 5 and order.used == 60 and _k(2) in order and _k(9) not in order
    order.add(_k(2), 100)  # replaces the size, never duplicates
    assert len(order) == 5 and order.used == 148 and order.size_of(_k(2)) == 100
    assert order.touch(_k(1)) and not order.touch(_k(9))
    assert order.remove(_k(2)) == 100 and order.remove(_k(2)) is None and order.size_of(_k(2)) is None
    assert order.used == 48 and len(order) == 4
    _check(order)


@pytest.mark.parametrize("name", NAMES)
def test_victims_free_enough_and_never_change_membership(name: str) -> None:
    order = make_order(name)
    for i in range(10):
        order.add(_k(i), 3)
    before = (set(order), order.used, len(order))
    victims = order.victims(7, 30, exclude=[_k(0)])
    assert (set(order), order.used, len(order)) == before
    assert _k(0) not in victims and len(set(victims)) == len(victims) == 3
    assert order.used - 3 * len(victims) + 7 <= 30
    assert order.victims(0, 30) == []  # nothing needed: "evict 0" is always safe
    every = order.victims(1000, 30, exclude=[_k(5)])
    assert sorted(every) == sorted(_k(i) for i in range(10) if i != 5)
    for key in victims:
        order.remove(key)
    assert order.used + 7 <= 30
    _check(order)


@pytest.mark.parametrize("name", NAMES)
def test_oldest_and_iteration_change_nothing(name: str) -> None:
    order = make_order(name)
    for i in range(6):
        order.add(_k(i), 1)
    snapshot = list(order)
    assert order.oldest(3) == snapshot[:3]
    assert order.oldest(10, exclude=[snapshot[0]]) == snapshot[1:]
    assert list(order) == snapshot


@pytest.mark.parametrize("name", NAMES)
def test_add_oldest_newest_first_rebuilds_access_order(name: str) -> None:
    """What the disk and file tiers do on reopen: blocks in reverse access order, each before the rest."""
    order = make_order(name)
    for i in reversed(range(5)):
        order.add_oldest(_k(i), 1)
    assert list(order) == [_k(i) for i in range(5)]
    assert order.victims(2, 5) == [_k(0), _k(1)]  # the least recently accessed go first


@pytest.mark.parametrize("name", NAMES)
@given(ops=st.lists(st.tuples(st.sampled_from("aotrv"), st.integers(0, 15), st.integers(1, 4)), max_size=80))
@settings(max_examples=40, deadline=None)
def test_bookkeeping_holds_under_random_operations(name: str, ops: list[tuple[str, int, int]]) -> None:
    order, budget = make_order(name), 20
    for op, i, size in ops:
        if op == "a":
            order.add(_k(i), size)
        elif op == "o":
            order.add_oldest(_k(i), size)
        elif op == "t":
            assert order.touch(_k(i)) == (_k(i) in order)
        elif op == "r":
            order.remove(_k(i))
        else:
            for key in order.victims(size, budget, exclude=[_k(i)]):
                order.remove(key)
            assert order.used + size <= budget or set(order) <= {_k(i)}
        _check(order)


class _Filter(KeyFilter):
    """Skips the keys of ``keys``; refuses to be iterated (an order must only ask ``in``)."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys, self.asked = keys, 0

    def __contains__(self, key: object) -> bool:
        self.asked += 1
        return key in self.keys

    def __iter__(self) -> object:
        raise AssertionError("a KeyFilter was iterated")


@pytest.mark.parametrize("name", NAMES)
def test_a_key_filter_skips_as_the_same_set_would_and_is_only_asked_about_candidates(name: str) -> None:
    with_set, with_filter = make_order(name), make_order(name)
    for order in (with_set, with_filter):
        for i in range(200):
            order.add(_k(i), 1)
        for i in range(0, 200, 3):
            order.touch(_k(i))
    skipped = {_k(i) for i in range(0, 200, 7)}
    flt = _Filter(skipped)
    assert with_filter.oldest(20, flt) == with_set.oldest(20, skipped)
    flt.asked = 0
    victims = with_filter.victims(20, 200, exclude=flt)
    assert victims == with_set.victims(20, 200, exclude=skipped) and not skipped & set(victims)
    # victims asked about the keys it visited on the way to 20, not about all 200.
    assert 20 <= flt.asked < 200, flt.asked
    assert skip_set(flt) is flt and skip_set(skipped) is skipped and skip_set([_k(1)]) == {_k(1)}
