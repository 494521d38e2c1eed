"""RouterIndex: what each replica holds, removals only from their sender, the shared remote tier for all."""

from __future__ import annotations

import pytest

from kvstore.route.index import PrefixHit, RouterIndex
from kvstore.route.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventFormatError, KVEventBatch

K = [bytes([i]) * 32 for i in range(8)]


def _stored(keys: list[bytes], medium: str | None = "GPU") -> BlockStored:
    return BlockStored(block_hashes=list(keys), parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium=medium, lora_name=None)


def _batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))  # type: ignore[arg-type]


@pytest.fixture
def index() -> RouterIndex:
    idx = RouterIndex()
    idx.apply("a", _batch(_stored(K[:4], "GPU"), _stored(K[2:4], "CPU")))
    idx.apply("b", _batch(_stored(K[:2], "GPU"), _stored(K[2:3], "STORAGE")))
    idx.check_integrity()
    return idx


def test_cached_prefix_counts_each_block_in_its_fastest_tier(index: RouterIndex) -> None:
    hits = index.cached_prefix(K[:5])
    assert hits == {"a": PrefixHit(4, {"gpu": 4}), "b": PrefixHit(3, {"gpu": 2, "disk": 1})}
    index.apply("a", _batch(BlockRemoved(K[2:4], "GPU")))
    assert index.cached_prefix(K[:5])["a"] == PrefixHit(4, {"gpu": 2, "host": 2})
    assert index.tiers("a", K[3]) == {"host"}
    index.check_integrity()


def test_prefix_stops_at_the_first_block_not_held(index: RouterIndex) -> None:
    index.apply("a", _batch(BlockRemoved([K[1]], "GPU")))
    assert index.cached_prefix(K[:4])["a"] == PrefixHit(1, {"gpu": 1})
    assert index.cached_prefix([K[5], K[0]]) == {"a": PrefixHit(0, {}), "b": PrefixHit(0, {})}


def test_removal_applies_only_to_its_sender(index: RouterIndex) -> None:
    index.apply("b", _batch(BlockRemoved(K[:4], "GPU"), BlockRemoved(K[:4], None)))
    assert index.cached_prefix(K[:4]) == {"a": PrefixHit(4, {"gpu": 4}), "b": PrefixHit(0, {})}
    assert index.blocks("b") == 0 and index.blocks("a") == 4
    index.check_integrity()


def test_removed_with_no_medium_takes_every_tier(index: RouterIndex) -> None:
    index.apply("a", _batch(BlockRemoved([K[3]], None)))
    assert index.tiers("a", K[3]) == set()
    assert index.tiers("a", K[2]) == {"gpu", "host"}


def test_all_cleared_clears_one_replica(index: RouterIndex) -> None:
    index.apply("a", _batch(AllBlocksCleared(), _stored([K[6]])))
    assert index.blocks("a") == 1 and index.blocks("b") == 3
    assert index.replicas() == ["a", "b"]
    index.check_integrity()


def test_remote_blocks_count_for_every_replica_until_their_reporter_removes_them(index: RouterIndex) -> None:
    index.add_replica("c")
    index.apply("a", _batch(_stored([K[4]], "REMOTE")))
    hits = index.cached_prefix(K[:5])
    assert hits["a"] == PrefixHit(5, {"gpu": 4, "remote": 1})
    assert hits["c"] == PrefixHit(0, {})  # K[0..3] are in a's own tiers only
    assert index.cached_prefix([K[4]])["c"] == PrefixHit(1, {"remote": 1})
    index.apply("c", _batch(BlockRemoved([K[4]], "REMOTE")))  # not c's report: a's stays
    assert index.cached_prefix([K[4]])["c"] == PrefixHit(1, {"remote": 1})
    index.apply("a", _batch(BlockRemoved([K[4]], "REMOTE")))
    assert index.cached_prefix([K[4]])["c"] == PrefixHit(0, {})
    index.check_integrity()


def test_clear_forgets_the_replicas_remote_reports(index: RouterIndex) -> None:
    index.apply("b", _batch(_stored([K[5]], "REMOTE")))
    index.clear("b")
    assert index.cached_prefix([K[5]])["a"] == PrefixHit(0, {})
    index.check_integrity()


def test_unknown_medium_raises_and_changes_nothing(index: RouterIndex) -> None:
    before = index.cached_prefix(K[:6])
    with pytest.raises(EventFormatError, match="unknown medium 'TAPE'"):
        index.apply("a", _batch(_stored([K[5]]), BlockRemoved(K[:4], "TAPE")))
    assert index.cached_prefix(K[:6]) == before
    index.check_integrity()


def test_vllm_integer_hashes_are_indexed_as_given() -> None:
    idx = RouterIndex()
    idx.apply("vllm-0", _batch(_stored([11, 12, 13], "GPU")))
    assert idx.cached_prefix([11, 12, 99]) == {"vllm-0": PrefixHit(2, {"gpu": 2})}


def test_a_stores_blocks_count_only_for_the_replicas_it_serves(index: RouterIndex) -> None:
    index.add_replica("c")
    index.add_store("daemon", serves=["b", "c"])
    index.apply("daemon", _batch(_stored(K[:3], "CPU"), _stored(K[3:5], "STORAGE")))
    hits = index.cached_prefix(K[:6])
    assert set(hits) == {"a", "b", "c"}  # the store is never a routing target
    assert hits["a"] == PrefixHit(4, {"gpu": 4})  # a does not share the daemon
    assert hits["b"] == PrefixHit(5, {"gpu": 2, "host": 1, "disk": 2})  # its own K[2] on disk, the store's in host
    assert hits["c"] == PrefixHit(5, {"host": 3, "disk": 2})
    assert index.replicas() == ["a", "b", "c"] and index.stores() == ["daemon"]
    index.check_integrity()


def test_a_store_serving_every_replica_counts_for_one_added_later(index: RouterIndex) -> None:
    index.add_store("daemon")
    index.apply("daemon", _batch(_stored(K[:2], "CPU")))
    index.add_replica("c")
    assert index.cached_prefix(K[:2])["c"] == PrefixHit(2, {"host": 2})


def test_a_stores_removals_and_clears_touch_only_its_own_report(index: RouterIndex) -> None:
    index.add_store("daemon", serves=["b"])
    index.apply("daemon", _batch(_stored(K[:4], "STORAGE")))
    assert index.cached_prefix(K[:4])["b"] == PrefixHit(4, {"gpu": 2, "disk": 2})
    index.apply("daemon", _batch(BlockRemoved([K[3]], "STORAGE")))
    assert index.cached_prefix(K[:4])["b"] == PrefixHit(3, {"gpu": 2, "disk": 1})  # b's own K[2] is on disk too
    index.apply("daemon", _batch(AllBlocksCleared()))
    assert index.cached_prefix(K[:4])["b"] == PrefixHit(3, {"gpu": 2, "disk": 1})  # b's own report stands
    assert index.blocks("daemon") == 0 and index.blocks("b") == 3
    index.apply("b", _batch(BlockRemoved(K[:4], None)))
    index.apply("daemon", _batch(_stored([K[0]], "CPU")))
    assert index.cached_prefix(K[:2])["b"] == PrefixHit(1, {"host": 1})
    index.check_integrity()


def test_a_store_and_a_replica_cannot_share_a_name(index: RouterIndex) -> None:
    with pytest.raises(ValueError, match="'a' is a replica"):
        index.add_store("a")
    index.add_store("d")
    with pytest.raises(ValueError, match="'d' is a store"):
        index.add_replica("d")
