"""S3-FIFO order: exact victims on hand-made sequences (small-queue FIFO, promotion, ghost readmission,
frequency second chance, saturation), and what ``victims`` may change."""

from __future__ import annotations

import pytest

from kvstore.policy.s3fifo import S3FIFOIndex


def _k(name: str) -> bytes:
    return name.encode()


def _names(keys: list[bytes]) -> list[str]:
    return [k.decode() for k in keys]


def _put(idx: S3FIFOIndex, name: str, budget: int) -> list[str]:
    """What a tier does for one block of size 1: ask for victims, remove them, add the block."""
    victims = idx.victims(1, budget)
    for key in victims:
        assert idx.remove(key) == 1
    idx.add(_k(name), 1)
    return _names(victims)


def _queues(idx: S3FIFOIndex) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"small": [], "main": []}
    for key in idx:
        out[str(idx.queue_of(key))].append(key.decode())
    return out


def test_one_hit_blocks_leave_from_the_small_queue_in_fifo_order() -> None:
    idx = S3FIFOIndex()  # budget 10: small share 1 block, so the small queue is drained first
    for i in range(10):
        assert _put(idx, f"a{i}", 10) == []
    assert _queues(idx) == {"small": [f"a{i}" for i in range(10)], "main": []}
    assert [_put(idx, f"b{i}", 10) for i in range(3)] == [["a0"], ["a1"], ["a2"]]
    assert all(idx.queue_of(_k(f"a{i}")) == "ghost" for i in range(3))


def test_re_referenced_small_block_moves_to_main_and_survives_the_scan() -> None:
    idx = S3FIFOIndex()
    for i in range(10):
        _put(idx, f"a{i}", 10)
    assert idx.touch(_k("a1")) and idx.touch(_k("a3"))
    assert _put(idx, "b0", 10) == ["a0"]
    assert _put(idx, "b1", 10) == ["a2"]  # a1 (freq 1) passed to main on the way
    assert idx.queue_of(_k("a1")) == "main" and idx.freq_of(_k("a1")) == 1  # the frequency travels with it
    assert _put(idx, "b2", 10) == ["a4"]  # a3 promoted likewise
    assert _queues(idx)["main"] == ["a1", "a3"]
    scan = [_put(idx, f"s{i}", 10) for i in range(12)]  # a long scan of one-hit blocks
    assert [v for vs in scan for v in vs][:8] == ["a5", "a6", "a7", "a8", "a9", "b0", "b1", "b2"]
    assert _k("a1") in idx and _k("a3") in idx  # the scan never reached main


def test_ghost_hit_is_readmitted_to_main_and_ghost_forgets_it() -> None:
    idx = S3FIFOIndex()
    for i in range(10):
        _put(idx, f"a{i}", 10)
    assert _put(idx, "b0", 10) == ["a0"]
    assert idx.queue_of(_k("a0")) == "ghost" and _k("a0") not in idx
    assert _put(idx, "a0", 10) == ["a1"]
    assert idx.queue_of(_k("a0")) == "main" and idx.freq_of(_k("a0")) == 0
    assert _put(idx, "a1", 10) == ["a2"]  # a1 was in the ghost too
    assert _queues(idx)["main"] == ["a0", "a1"]


def test_main_evicts_with_second_chance_by_frequency() -> None:
    idx = S3FIFOIndex()
    for name in ("m3", "m2", "m1"):  # add_oldest: each goes before the rest, so main = m1 m2 m3
        idx.add_oldest(_k(name), 1)
    idx.add(_k("s1"), 1)  # budget 20: small share 2 > 1 block in small, so eviction takes from main
    assert _queues(idx) == {"small": ["s1"], "main": ["m1", "m2", "m3"]}
    idx.touch(_k("m1"))
    assert _names(idx.victims(17, 20)) == ["m2"]  # m1 had a second chance: to the tail, freq 1 -> 0
    assert _queues(idx)["main"] == ["m2", "m3", "m1"] and idx.freq_of(_k("m1")) == 0
    assert _k("m2") in idx and len(idx) == 4 and idx.used == 4  # victims never removes
    idx.remove(_k("m2"))
    for _ in range(5):
        idx.touch(_k("m3"))
    assert idx.freq_of(_k("m3")) == 3  # saturates
    assert _names(idx.victims(18, 20)) == ["m1"]  # m3 passes (3 -> 2), then m1 (freq 0) goes
    assert _names(idx.victims(18, 20)) == ["m1"]  # not removed: offered first again
    assert idx.freq_of(_k("m3")) == 2


def test_victims_falls_back_to_the_other_queue_and_honours_exclude() -> None:
    idx = S3FIFOIndex()
    for name in ("a", "b", "c"):
        idx.add(_k(name), 2)
    idx.add_oldest(_k("m"), 2)
    assert _names(idx.victims(4, 8, exclude=[_k("a")])) == ["b", "c"]
    assert list(idx) == [_k("a"), _k("b"), _k("c"), _k("m")]  # excluded and chosen keep their places
    assert _names(idx.victims(100, 8, exclude=[_k("b")])) == ["a", "c", "m"]  # not enough: all but b
    assert idx.used == 8


def test_add_of_a_resident_key_replaces_its_size_in_place() -> None:
    idx = S3FIFOIndex()
    idx.add(_k("a"), 1)
    idx.add(_k("b"), 1)
    idx.touch(_k("a"))
    idx.add(_k("a"), 5)
    assert list(idx) == [_k("a"), _k("b")] and idx.size_of(_k("a")) == 5 and idx.used == 6
    assert idx.freq_of(_k("a")) == 1


def test_ghost_is_bounded_by_budgets_of_keys() -> None:
    idx = S3FIFOIndex(ghost_budgets=0.5)  # 5 keys at budget 10
    for i in range(30):
        _put(idx, f"a{i}", 10)
    ghosts = [f"a{i}" for i in range(30) if idx.queue_of(_k(f"a{i}")) == "ghost"]
    assert ghosts == [f"a{i}" for i in range(15, 20)]


@pytest.mark.parametrize("kwargs", [{"small_fraction": 0}, {"small_fraction": 1}, {"ghost_budgets": -1}])
def test_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        S3FIFOIndex(**kwargs)
