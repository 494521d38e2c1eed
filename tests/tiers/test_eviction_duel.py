"""``DuelIndex`` (``eviction: duel``): contenders over the same keys, victims from the one whose miniature hits
more; a referee shared by the host and disk duels (``policy.placement: adaptive``); and S3-FIFO's
``seed_to_main`` and ``ghost_loaded``, the contenders' options; a trailing S3-FIFO contender's ghost; GDSF's count weight (``policy.gdsf_weight``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import parse_config
from kvstore.layout import KVLayout
from kvstore.lower.build import build_lower_tiers
from kvstore.tiers.lmdb.tier import DiskTier
from kvstore.policy.duel import MARGIN, SHARED_MARGIN, DuelIndex, DuelReferee, shared_duel
from kvstore.policy.order import make_order, order_for
from kvstore.policy.gdsf import DAMPED, LINEAR, GDSFIndex
from kvstore.policy.lru import LRUIndex
from kvstore.policy.named import placement_policy
from kvstore.policy.s3fifo import S3FIFOIndex


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


def _pair(margin: float = 1.0) -> tuple[DuelIndex, DuelIndex]:
    """Host (level 0) and disk (level 1) duels of one referee that samples every key."""
    referee = DuelReferee(("gdsf", "s3fifo"), sample=1, window=1000, margin=margin, levels=2)
    return DuelIndex(referee=referee, level=0), DuelIndex(referee=referee, level=1)


def test_a_shared_referee_scores_hits_of_both_tiers_and_no_moves_between_them() -> None:
    host, disk = _pair()
    assert host.referee is disk.referee
    host.add(_k(1), 1)  # from the GPU: an access, both miniatures insert it
    host.remove(_k(1))
    disk.add(_k(1), 1)  # the host's victim spilled to disk: a move inside the pair, not an access
    assert host.scores == [0.0, 0.0]
    assert disk.touch(_k(1))  # a disk hit scores
    assert host.scores == [1.0, 1.0]
    disk.remove(_k(1))  # loaded into the GPU (exclusive tiers) ...
    host.add(_k(1), 1)  # ... and demoted back: not a new request
    assert host.scores == [1.0, 1.0]
    assert host.touch(_k(1))  # a host hit scores the same miniatures as the disk hit did
    assert disk.scores == [2.0, 2.0]
    disk.add(_k(2), 1)
    disk.remove(_k(2))  # dropped from the lowest tier: gone from the pair
    host.add(_k(2), 1)  # recomputed and demoted: a request the miniatures would have served
    assert host.scores == [3.0, 3.0]


def test_a_shared_referee_budgets_the_pair_in_blocks() -> None:
    host, disk = _pair()
    for i in range(4):
        host.add(_k(i), 1)
    for i in range(4, 6):
        disk.add(_k(i), 100)  # the disk tier accounts bytes
    assert host.victims(1, 4) == [_k(0)] and host.referee.mini_budget is None  # the disk's budget not known yet
    assert disk.victims(100, 200) == [_k(4)]  # 200 bytes of 100-byte blocks: 2 blocks
    assert host.referee.mini_budget == 4 + 2


def test_both_tiers_of_a_shared_duel_follow_one_leader() -> None:
    """The cycle of the first test, reaching the pair through the host tier: its lead moves the disk tier too."""
    host, disk = _pair()
    disk.victims(0, 0)  # an empty disk: the pair's budget is the host's
    for i in [0, 1, 2, 3, 4, 5] * 3:
        assert not _access(host, i, 4)
    assert host.leader_name == disk.leader_name == "s3fifo" and host.switches == disk.switches == 1
    for i in range(6, 9):
        disk.add(_k(i), 1)
    assert disk.victims(1, 3) == [_k(6)]  # the leader's: S3-FIFO's small-queue head
    assert disk.oldest(3) == [_k(6), _k(7), _k(8)]


def test_a_shared_duel_remembers_loaded_blocks_in_its_s3fifo_ghosts() -> None:
    host, _ = shared_duel(2)
    private = DuelIndex()
    for d in (host, private):
        d.add(_k(1), 1)
        d.touch(_k(1))
        d.remove(_k(1))  # loaded into the GPU
        d.add(_k(1), 1)  # demoted back
    queues = [o.queue_of(_k(1)) for o in host._orders[1:]]  # noqa: SLF001 - the contenders' queues are the point
    assert queues == ["main", "main"]
    assert [o.queue_of(_k(1)) for o in private._orders[1:]] == ["small", "small"]  # noqa: SLF001
    assert host.referee.margin == SHARED_MARGIN and private.referee.margin == MARGIN


def test_shared_duel_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="two or more tiers"):
        shared_duel(1)
    with pytest.raises(ValueError, match="level 2 outside"):
        DuelIndex(referee=DuelReferee(levels=2), level=2)
    with pytest.raises(ValueError, match="levels >= 1"):
        DuelReferee(levels=0)


def test_a_tier_takes_only_an_empty_order_and_evicts_lru_when_given_none() -> None:
    host, _ = shared_duel(2)
    assert order_for(host) is host and isinstance(order_for(None), LRUIndex)
    host.add(_k(1), 1)
    with pytest.raises(ValueError, match="already holds 1 keys"):
        order_for(host)


@pytest.mark.parametrize("ghost_loaded", [False, True])
def test_s3fifo_ghost_loaded_sends_a_returning_block_to_main(ghost_loaded: bool) -> None:
    order = S3FIFOIndex(ghost_loaded=ghost_loaded)
    order.add(_k(1), 1)
    order.add(_k(2), 1)
    order.touch(_k(1))
    assert order.remove(_k(1)) == 1 and order.remove(_k(2)) == 1 and order.used == 0
    assert order.queue_of(_k(1)) == ("ghost" if ghost_loaded else None)
    assert order.queue_of(_k(2)) is None  # never used while here: forgotten either way
    order.add(_k(1), 1)
    order.add(_k(2), 1)
    assert order.queue_of(_k(1)) == ("main" if ghost_loaded else "small") and order.queue_of(_k(2)) == "small"


@pytest.mark.parametrize("placement", ["lru", "s3fifo", "gdsf", "adaptive"])
def test_the_store_builds_host_and_disk_with_the_named_policys_orders(tmp_path: Path, placement: str) -> None:
    """``policy.placement``: the tiers the store builds evict through the orders the named policy builds;
    ``adaptive``'s are two duels of one referee, GDSF weighed damped; ``gdsf``'s weigh linearly."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, model_id="placement-orders")
    cfg = parse_config({"tiers": ["host", "lmdb"], "host": {"capacity": "64KiB"},
                        "disk": {"path": str(tmp_path / placement), "max_size": "1MiB"},
                        "policy": {"placement": placement}})
    tiers = build_lower_tiers(cfg, layout)
    assert tiers.host is not None and isinstance(tiers.disk, DiskTier)
    kind = {"lru": LRUIndex, "s3fifo": S3FIFOIndex, "gdsf": GDSFIndex, "adaptive": DuelIndex}[placement]
    try:
        host_order, disk_order = tiers.host._order, tiers.disk._lru  # noqa: SLF001 - the orders are the point
        assert type(host_order) is kind and type(disk_order) is kind and host_order is not disk_order
        if isinstance(host_order, DuelIndex) and isinstance(disk_order, DuelIndex):
            assert host_order.referee is disk_order.referee and (host_order.level, disk_order.level) == (0, 1)
            assert host_order.referee.weight == DAMPED
        if isinstance(host_order, GDSFIndex) and isinstance(disk_order, GDSFIndex):
            assert host_order.weight == disk_order.weight == LINEAR
    finally:
        tiers.host.close()
        tiers.disk.close()


def test_adaptive_without_a_disk_tier_gives_the_host_its_own_duel() -> None:
    policy = placement_policy("adaptive")
    alone = policy.orders(both_tiers=False)
    assert isinstance(alone.host, DuelIndex) and isinstance(alone.disk, DuelIndex)
    assert alone.host.referee is not alone.disk.referee and alone.host.referee.weight == DAMPED


@pytest.mark.parametrize("ghost_victims", [False, True])
def test_an_s3fifo_contender_not_leading_ghosts_the_leader_s_small_queue_victims(ghost_victims: bool) -> None:
    """``ghost_victims`` (a shared duel's referee): the leader's victim leaves a trailing S3-FIFO contender's small
    queue into its ghost (as its own victim would), so the block enters its main queue when it comes back; a
    block removed otherwise (a load) is only forgotten. Without it (a private referee) the victim is forgotten."""
    referee = DuelReferee(("gdsf", "s3fifo"), sample=1 << 30, ghost_victims=ghost_victims)  # nothing sampled
    d = DuelIndex(referee=referee)
    s3 = d._orders[1]  # noqa: SLF001 - the trailing contender is the point
    assert isinstance(s3, S3FIFOIndex)
    for i in range(3):
        d.add(_k(i), 1)
    d.touch(_k(0))
    d.touch(_k(2))
    assert d.victims(1, 3) == [_k(1)] and d.leader_name == "gdsf"
    assert d.remove(_k(1)) == 1 and s3.queue_of(_k(1)) == ("ghost" if ghost_victims else None)
    assert d.remove(_k(2)) == 1 and s3.queue_of(_k(2)) is None  # not a victim: a load
    d.add(_k(1), 1)
    assert s3.queue_of(_k(1)) == ("main" if ghost_victims else "small")
    assert shared_duel(2)[0].referee.ghost_victims and not DuelIndex().referee.ghost_victims


def test_s3fifo_remove_evicted_ghosts_small_queue_keys_only() -> None:
    order = S3FIFOIndex(ghost_budgets=1)
    for i in range(4):
        order.add(_k(i), 1)
    order.touch(_k(0))
    assert order.victims(1, 4) == [_k(1)]  # 0 (used) moves to main on the way
    order.remove(_k(1))
    assert order.queue_of(_k(0)) == "main" and order.queue_of(_k(1)) == "ghost"
    assert order.remove_evicted(_k(0), 4) == 1 and order.queue_of(_k(0)) is None  # main: forgotten
    assert order.remove_evicted(_k(2), 1) == 1 and order.queue_of(_k(2)) == "ghost"
    assert order.queue_of(_k(1)) is None  # the ghost trimmed to 1 x the budget of 1: key 1, the oldest, goes
    assert order.remove_evicted(_k(9), 4) is None and order.used == 1


def test_the_gdsf_count_weight_reaches_every_gdsf_order_and_miniature() -> None:
    """``policy.gdsf_weight``: a duel's GDSF contender (full order and miniature) weighs counts as told, private
    or shared; the S3-FIFO contenders have no weight."""
    private = DuelIndex(weight=DAMPED)
    host, disk = shared_duel(2, DAMPED)
    for d in (private, host, disk):
        gdsf = [o for o in d._orders if isinstance(o, GDSFIndex)]  # noqa: SLF001 - the contenders are the point
        minis = [m for m in d.referee._minis if isinstance(m, GDSFIndex)]  # noqa: SLF001
        assert [o.weight for o in gdsf + minis] == [DAMPED, DAMPED] and d.referee.weight == DAMPED
    assert isinstance(make_order("duel", DAMPED), DuelIndex) and make_order("duel").referee.weight == LINEAR  # type: ignore[attr-defined]
