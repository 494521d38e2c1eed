"""``UseMemory``: the bounded memory of use counts of blocks that left every tier (``policy.placement: adaptive``)."""

from __future__ import annotations

import pytest

from kvstore.policy.named import POLICIES
from kvstore.policy.use_memory import UseMemory


def _k(i: int) -> bytes:
    return i.to_bytes(8, "little")


def test_forgets_the_oldest_beyond_capacity_and_recall_takes_the_count() -> None:
    m = UseMemory(3)
    for i, uses in ((1, 5), (2, 1), (3, 7), (4, 2)):
        m.remember(_k(i), uses)
    assert len(m) == 3 and _k(1) not in m  # the oldest went
    assert [m.uses_of(_k(i)) for i in (2, 3, 4)] == [1, 7, 2]
    assert m.recall(_k(3)) == 7 and _k(3) not in m  # back in an index entry: forgotten here
    assert m.recall(_k(3)) == 0 and m.recall(_k(1)) == 0


def test_remembering_again_refreshes_a_key_and_replaces_its_count() -> None:
    m = UseMemory(2)
    m.remember(_k(1), 3)
    m.remember(_k(2), 1)
    m.remember(_k(1), 9)  # dropped again: newest now, with its latest count
    m.remember(_k(3), 1)  # so 2 is the oldest and goes
    assert [m.uses_of(_k(i)) for i in (1, 2, 3)] == [9, None, 1]


def test_bounded_whatever_is_remembered() -> None:
    m = UseMemory(16)
    for i in range(1000):
        m.remember(_k(i), i + 1)
        assert len(m) <= 16
    assert [m.uses_of(_k(i)) for i in (983, 984, 999)] == [None, 985, 1000]


def test_capacity_zero_remembers_nothing_and_negative_is_refused() -> None:
    m = UseMemory(0)
    m.remember(_k(1), 4)
    assert len(m) == 0 and m.recall(_k(1)) == 0
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        UseMemory(-1)


def test_only_adaptive_remembers_counts_and_it_carries_them() -> None:
    remembering = {name: p.use_memory for name, p in POLICIES.items() if p.use_memory > 0}
    assert remembering == {"adaptive": 4.0}
    assert all(POLICIES[name].carry_uses for name in remembering)  # a remembered count is resumed into an entry
