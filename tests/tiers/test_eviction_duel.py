"""``DuelIndex`` (``eviction: duel``): contenders over the same keys, victims from the one whose miniature hits
more; and S3-FIFO's ``seed_to_main``, the contender that honours carried counts."""

from __future__ import annotations

import pytest

from kvstore.tiers.duel import DuelIndex
from kvstore.tiers.gdsf import GDSFIndex
from kvstore.tiers.s3fifo import S3FIFOIndex


def _k(i: int) -> bytes:
    return i.to_bytes(4, "little")


def _ids(order: DuelIndex) -> list[int]:
    return [int.from_bytes(k, "little") for k in order]


def _access(d: DuelIndex, i: int, budget: int) -> bool:
    """What a tier does for a request of block ``i``: a hit touches it, a miss makes room and adds it."""
    if d.touch(_k(i)):
        return True
    for v in d.victims(1, budget):
        d.remove(v)
    d.add(_k(i), 1)
    return False


def test_a_cycle_longer_than_the_tier_hands_the_lead_to_s3fifo() -> None:
    """Keys 0-5 in a cycle through 4 units: GDSF (equal counts) evicts each key just before it comes back;
    S3-FIFO's miniature keeps the keys its ghost sent to main and scores on the third cycle."""
    d = DuelIndex(("gdsf", "s3fifo"), sample=1, window=1000, margin=1.0)
    leaders = []
    for i in [0, 1, 2, 3, 4, 5] * 3:
        assert not _access(d, i, 4)
        leaders.append(d.leader_name)
    assert leaders == ["gdsf"] * 15 + ["s3fifo"] * 3 and d.switches == 1
    assert d.scores == [0.0, 3.0]
    assert _ids(d) == [2, 3, 4, 5]  # the tier's own content: chosen by GDSF until the switch
    assert d.oldest(2) == [_k(2), _k(3)]


def test_every_contender_holds_the_tier_keys_and_the_leader_chooses() -> None:
    d = DuelIndex(("gdsf", "s3fifo"), sample=1)
    for i in range(4):
        d.add(_k(i), 2)
    d.touch(_k(0))
    assert len(d) == 4 and d.used == 8 and d.size_of(_k(1)) == 2 and _k(3) in d
    assert d.victims(2, 8) == [_k(1)]  # GDSF: lowest L + count, the oldest use first
    assert d.remove(_k(1)) == 2 and _k(1) not in d and d.used == 6
    assert d.seed(_k(2), 5) and not d.seed(_k(9), 5) and not d.touch(_k(9))


def test_a_block_loaded_from_the_tier_and_demoted_back_is_one_access() -> None:
    """Exclusive tiers: a hit loads the block (touch, remove); its return by demotion (add) is no new request."""
    d = DuelIndex(("gdsf", "s3fifo"), sample=1)
    d.add(_k(1), 1)  # an access: both miniatures insert it
    assert d.touch(_k(1))  # a hit: both miniatures score
    assert d.scores == [1.0, 1.0]
    d.remove(_k(1))
    d.add(_k(1), 1)  # back from the GPU: not scored again
    assert d.scores == [1.0, 1.0]
    d.remove(_k(1))
    d.add(_k(1), 1)  # recomputed and demoted: a request the miniatures would have served
    assert d.scores == [2.0, 2.0]


def test_memory_is_bounded_by_the_budget() -> None:
    d = DuelIndex(sample=4, window=64)
    for i in range(5000):
        _access(d, i % 700, 64)
        assert len(d) <= 64
    minis = d.referee._minis  # noqa: SLF001 - the miniatures' sizes are the bound being tested
    assert all(m.used <= 64 // 4 for m in minis) and len(d.referee._loaded) <= max(64, 4 * len(minis[0]))  # noqa: SLF001


def test_bad_contenders_are_refused() -> None:
    with pytest.raises(ValueError, match="two or more distinct contenders"):
        DuelIndex(("gdsf",))
    with pytest.raises(ValueError, match="two or more distinct contenders"):
        DuelIndex(("gdsf", "arc"))
    with pytest.raises(ValueError, match="sample >= 1"):
        DuelIndex(sample=0)
    assert isinstance(DuelIndex()._orders[0], GDSFIndex)  # noqa: SLF001 - gdsf leads first


@pytest.mark.parametrize("seed_to_main", [False, True])
def test_s3fifo_seed_to_main_skips_the_small_queue(seed_to_main: bool) -> None:
    order = S3FIFOIndex(seed_to_main=seed_to_main)
    order.add(_k(1), 1)
    order.add(_k(2), 1)
    assert order.seed(_k(1), 2) and order.seed(_k(2), 1) and not order.seed(_k(3), 2)
    assert order.queue_of(_k(1)) == ("main" if seed_to_main else "small")
    assert order.queue_of(_k(2)) == "small" and order.used == 2  # one use: no history, stays in small
