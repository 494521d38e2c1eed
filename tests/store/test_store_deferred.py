"""Deferred runs: a GPU-only commit makes no BlockEntry until one is read, and every
path that reads one (lookup, key probes, eviction, a refused commit, pins) sees the same state as if the
entries had been made at commit."""

from __future__ import annotations

import pytest

from kvstore.errors import IntegrityError, PlacementError
from kvstore.store.radix import BlockEntry, RadixIndex, RadixNode

from storelib import LAYOUT, make_store


def toks(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * LAYOUT.block_size))


def _leaf(s, tokens: list[int]) -> RadixNode:  # type: ignore[no-untyped-def]
    node = s.index.root.children[s.keys(tokens)[0]]
    assert isinstance(node, RadixNode)
    return node


def test_a_gpu_only_commit_and_free_make_no_entry_and_queue_the_blocks_tail_first() -> None:
    s = make_store(gpu_blocks=8, host_blocks=None)
    keys, blocks = s.keys(toks(0, 3)), s.allocate(3)
    assert s.commit(keys, blocks, toks(0, 3)) == 3
    leaf = _leaf(s, toks(0, 3))
    assert leaf.is_deferred and leaf.num_blocks == 3 and len(s.index) == 3
    assert [s.pool.ref_count(b) for b in blocks] == [2, 2, 2]
    s.free(blocks)
    assert leaf.is_deferred  # free needs no entry
    assert s.h.placement.gpu_lru.order() == [blocks[2], blocks[1], blocks[0]]
    assert s.stats()["gpu"]["cached_blocks"] == 3
    e1 = s.index.get(keys[1])  # the first read makes the run's entries
    assert not leaf.is_deferred and isinstance(e1, BlockEntry)
    assert [e.key for e in leaf.entries] == keys and [e.gpu_block for e in leaf.entries] == blocks
    assert all(e.node is leaf and e.hits == 0 and e.host_slot is None and not e.on_disk for e in leaf.entries)
    assert [s.h.placement.entry_of(b) for b in blocks] == leaf.entries  # the block map now holds the entries
    assert [s.index.get(k) for k in keys] == leaf.entries
    assert s.h.placement.oldest_gpu() is leaf.entries[2]
    assert s.h.placement.gpu_lru.order() == [blocks[2], blocks[1], blocks[0]]
    s.check_integrity()


def test_a_lookup_of_a_deferred_run_matches_it_whole_and_touches_it() -> None:
    s = make_store(gpu_blocks=8, host_blocks=None)
    keys, blocks = s.keys(toks(0, 4)), s.allocate(4)
    s.commit(keys, blocks, toks(0, 4))
    s.free(blocks)
    m = s.lookup(toks(0, 4) + [7])
    assert m.num_blocks == 4 and m.tiers == ("gpu",) * 4 and m.keys == tuple(keys)
    assert [e.gpu_block for e in m.entries] == blocks
    assert s.h.placement.gpu_lru.order() == [blocks[3], blocks[2], blocks[1], blocks[0]]
    s.check_integrity()


def test_key_probes_find_deferred_runs_by_bisection_and_by_scan() -> None:
    s = make_store(gpu_blocks=8, host_blocks=None)
    keys, blocks = s.keys(toks(0, 3)), s.allocate(3)
    s.commit(keys, blocks, None)  # keys only: found by key, not by token walk
    assert s.index.match_keys(keys).num_blocks == 3
    s2 = make_store(gpu_blocks=8, host_blocks=None)
    b2 = s2.allocate(3)
    s2.commit(keys, b2, None)
    got = s2.index.match_keys([keys[1], keys[2]])  # not a chain from the root: probed key by key
    assert [e.gpu_block for e in got.entries] == [b2[1], b2[2]]
    s.free(blocks)
    s2.free(b2)
    s.check_integrity()
    s2.check_integrity()


def test_eviction_straight_after_commit_takes_a_deferred_runs_tail_first_into_the_host_tier() -> None:
    s = make_store(gpu_blocks=4, host_blocks=8, write="write_back")
    keys, blocks = s.keys(toks(0, 3)), s.allocate(3)
    s.commit(keys, blocks, toks(0, 3))
    s.free(blocks)
    assert _leaf(s, toks(0, 3)).is_deferred
    own = s.allocate(2)  # one block free: the oldest cached one (the run's tail) is copied down and evicted
    assert s.lookup(toks(0, 3)).tiers == ("gpu", "gpu", "host")
    assert s.stats()["gpu"]["evictions"] == 1
    s.free(own)
    s.check_integrity()


def test_a_commit_refused_for_a_block_a_deferred_run_records_names_it_and_changes_nothing() -> None:
    s = make_store(gpu_blocks=8, host_blocks=None)
    first = s.allocate(2)
    s.commit(s.keys(toks(0, 2)), first, toks(0, 2))
    leaf = _leaf(s, toks(0, 2))
    other = s.allocate(2)
    with pytest.raises(PlacementError, match=f"GPU block {first[1]} already records {s.keys(toks(0, 2))[1].hex()[:8]}"):
        s.commit(s.keys(toks(50, 2)), [other[0], first[1]], toks(50, 2))
    assert [s.pool.ref_count(b) for b in (*first, *other)] == [2, 2, 1, 1]
    assert s.h.placement.entry_of(first[1]) is leaf.entries[1] and s.h.placement.entry_of(other[0]) is None
    assert len(s.index) == 2 and s.index.match_keys(s.keys(toks(50, 2))).num_blocks == 0
    s.free(first)
    s.free(other)
    s.check_integrity()


def test_a_commit_offering_one_block_twice_is_refused_and_indexes_nothing() -> None:
    s = make_store(gpu_blocks=8, host_blocks=None)
    (b,) = s.allocate(1)
    with pytest.raises(PlacementError, match=f"GPU block {b} already records another block of this commit"):
        s.commit(s.keys(toks(0, 2)), [b, b], toks(0, 2))
    assert s.pool.ref_count(b) == 1 and s.h.placement.entry_of(b) is None and len(s.index) == 0
    assert s.index.root.children == {} and s.index.root.tok_children == {}
    s.check_integrity()


def test_a_key_conflict_with_a_deferred_run_restores_its_keys() -> None:
    idx = RadixIndex(LAYOUT)
    keys = idx.keys_for(toks(0, 3))
    res = idx.insert(keys, gpu_blocks=[0, 1, 2])
    assert res.leaf is not None and res.leaf.is_deferred and res.num_new == 3 and res.existing == ()
    with pytest.raises(IntegrityError, match="already indexed under another prefix"):
        idx.insert([b"x" * 32, keys[1]], gpu_blocks=[5, 6])  # keys[1] under another prefix
    assert res.leaf.is_deferred and len(idx) == 3 and idx.get(b"x" * 32) is None
    assert [e.gpu_block for e in (idx.get(k) for k in keys)] == [0, 1, 2]  # type: ignore[union-attr]
    idx.check_integrity()


def test_a_commit_extending_a_deferred_run_keeps_its_entries_and_adds_a_child() -> None:
    s = make_store(gpu_blocks=8, host_blocks=None)
    a = s.allocate(2)
    s.commit(s.keys(toks(0, 2)), a, toks(0, 2))
    s.free(a)
    b = s.allocate(4)
    assert s.commit(s.keys(toks(0, 4)), b, toks(0, 4)) == 2  # the first two are cached: b[0], b[1] not recorded
    s.free(b)
    head = _leaf(s, toks(0, 2))
    tail = next(iter(head.children.values()))
    assert tail.is_deferred and [e.gpu_block for e in head.entries] == a
    assert s.h.placement.gpu_lru.order() == [a[1], a[0], b[3], b[2]]  # as with entries made at commit (checked)
    assert s.lookup(toks(0, 4)).num_blocks == 4
    s.check_integrity()


def test_pinning_a_deferred_run_through_acquire_keeps_it_off_the_eviction_queue() -> None:
    s = make_store(gpu_blocks=8, host_blocks=None)
    blocks = s.allocate(3)
    s.commit(s.keys(toks(0, 3)), blocks, toks(0, 3))
    s.free(blocks)
    lease = s.acquire(s.lookup(toks(0, 3)))
    assert s.h.placement.gpu_lru.order() == []
    s.release(lease)
    assert s.h.placement.gpu_lru.order() == [blocks[2], blocks[1], blocks[0]]
    s.check_integrity()


def test_the_index_tells_its_listener_once_with_the_runs_entries_and_blocks() -> None:
    idx = RadixIndex(LAYOUT)
    told: list[tuple[list[BlockEntry], list[int]]] = []
    idx.on_entries_made = lambda entries, gpu: told.append((list(entries), list(gpu)))
    keys = idx.keys_for(toks(0, 3))
    res = idx.insert(keys, gpu_blocks=[4, 5, 6], tokens=toks(0, 3))
    assert told == [] and res.num_new == 3
    assert idx.match(toks(0, 3)).num_blocks == 3
    assert len(told) == 1 and told[0][1] == [4, 5, 6] and [e.key for e in told[0][0]] == keys
    assert told[0][0] == res.new_entries == [idx.get(k) for k in keys]
    idx.match(toks(0, 3))
    assert len(told) == 1  # made once
    idx.check_integrity()


def test_removing_a_deferred_leaf_makes_no_entries_and_forgets_its_keys() -> None:
    idx = RadixIndex(LAYOUT)
    told: list[list[int]] = []
    idx.on_entries_made = lambda entries, gpu: told.append(gpu)
    keys = idx.keys_for(toks(0, 2))
    res = idx.insert(keys, gpu_blocks=[0, 1], tokens=toks(0, 2))
    assert res.leaf is not None
    idx.remove_leaf(res.leaf)
    assert told == [] and len(idx) == 0 and idx.get(keys[0]) is None and idx.match(toks(0, 2)).num_blocks == 0
    assert res.leaf.parent is None and res.leaf.entries == [] and not res.leaf.is_deferred
    idx.check_integrity()


def test_host_or_disk_residency_or_a_block_without_gpu_copy_is_indexed_with_entries_at_once() -> None:
    idx = RadixIndex(LAYOUT)
    a = idx.insert(idx.keys_for(toks(0, 2)), gpu_blocks=[0, None], on_disk=[True, True])
    b = idx.insert(idx.keys_for(toks(50, 2)), gpu_blocks=[2, 3], host_slots=[None, 1])
    assert a.leaf is not None and not a.leaf.is_deferred and b.leaf is not None and not b.leaf.is_deferred
    assert [e.on_disk for e in a.new_entries] == [True, True] and [e.host_slot for e in b.new_entries] == [None, 1]
    idx.check_integrity()
