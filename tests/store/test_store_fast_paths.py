"""The batched paths of lookup and commit keep exact behaviour: events, LRU order, tiers, copies."""

from __future__ import annotations

import pytest

from kvstore.errors import PlacementError
from kvstore.events import EventQueue, StoreEvent
from kvstore.policy.gpu_lru import GpuLru
from kvstore.store.radix import RadixIndex

from storelib import LAYOUT, make_store, prefill


def toks(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * LAYOUT.block_size))


def test_event_batches_drain_in_order_and_the_bound_drops_the_oldest_events_across_records() -> None:
    q = EventQueue(maxlen=5)
    q.put("stored", b"a", "gpu")
    q.put_many("stored", [b"b", b"c", b"d"], "gpu")
    q.put_many("evicted", (), "host")  # nothing to add: no record
    assert len(q) == 4 and q.dropped == 0
    q.put_many("spilled", [b"e", b"f", b"g"], "host")  # 7 > 5: a, then b, go
    assert len(q) == 5 and q.dropped == 2
    assert q.drain() == [StoreEvent("stored", b"c", "gpu"), StoreEvent("stored", b"d", "gpu"),
                         StoreEvent("spilled", b"e", "host"), StoreEvent("spilled", b"f", "host"),
                         StoreEvent("spilled", b"g", "host")]
    assert q.drain() == [] and len(q) == 0
    q.put_many("stored", [b"1", b"2", b"3", b"4", b"5", b"6", b"7"], "gpu")  # one record longer than the bound
    assert [e.key for e in q.drain()] == [b"3", b"4", b"5", b"6", b"7"] and q.dropped == 4
    with pytest.raises(ValueError, match="maxlen must be positive, got 0"):
        EventQueue(maxlen=0)


def test_commit_publishes_one_stored_event_per_new_block_in_chain_order() -> None:
    s = make_store(gpu_blocks=8, host_blocks=None)
    prefill(s, toks(0, 2))
    s.drain_events()
    keys = s.keys(toks(0, 4))
    blocks = s.allocate(4)  # the first two duplicate cached blocks: not recorded, the caller frees them
    assert s.commit(keys, blocks, toks(0, 4)) == 2
    assert s.drain_events() == [StoreEvent("stored", keys[2], "gpu"), StoreEvent("stored", keys[3], "gpu")]
    s.free(blocks)
    s.check_integrity()


def test_touch_all_moves_queued_blocks_in_order_and_skips_none_and_unqueued() -> None:
    lru = GpuLru()
    for b in (1, 2, 3, 4):
        lru.push(b)
    lru.touch_all([3, None, 9, 1])
    assert lru.order() == [2, 4, 3, 1]


def test_lookup_touches_the_matched_prefix_tail_first_and_reports_tiers_per_block() -> None:
    s = make_store(gpu_blocks=6, host_blocks=8, write="write_back")
    prefill(s, toks(0, 3))
    prefill(s, toks(100, 2))
    m = s.lookup(toks(0, 3))
    a = [e.gpu_block for e in m.entries]
    assert s.h.placement.gpu_lru.order()[-3:] == [a[2], a[1], a[0]]
    assert m.tiers == ("gpu", "gpu", "gpu")
    own = s.allocate(4)  # evicts (copies down) the 4 oldest: b's two blocks and a's tail
    m = s.lookup(toks(0, 3))
    assert m.tiers == ("gpu", "gpu", "host")
    assert s.stats()["host"]["hit_tokens"] == LAYOUT.block_size
    s.free(own)
    s.check_integrity()


def test_a_block_pending_removal_ends_the_match_with_its_node_and_tiers_cut_there() -> None:
    index = RadixIndex(LAYOUT)
    t = toks(0, 4)
    res = index.insert(index.keys_for(t), gpu_blocks=[0, 1, 2, 3], tokens=t)
    index.pin(res.node)
    res.entries[2].gpu_block = None  # what a lost last copy leaves while a request pins the node
    for m in (index.match(t), index.match_keys(index.keys_for(t))):
        assert m.num_blocks == 2 and m.tiers == ("gpu", "gpu") and m.node is res.node
        assert (m.gpu_blocks, m.host_blocks, m.disk_blocks) == (2, 0, 0)
    res.entries[0].gpu_block = None
    res.entries[0].on_disk = True
    m = index.match(t)
    assert m.tiers == ("disk", "gpu") and (m.gpu_blocks, m.host_blocks, m.disk_blocks) == (1, 0, 1)


def test_the_callers_token_list_is_read_not_kept() -> None:
    s = make_store(gpu_blocks=8, host_blocks=None)
    t = toks(0, 2)
    keys = s.keys(t)
    blocks = s.allocate(2)
    s.commit(keys, blocks, t)
    t[0] = 999_999  # the engine's list changes afterwards
    assert s.lookup(toks(0, 2)).num_blocks == 2
    mine = toks(0, 2)
    m = s.lookup(mine)
    mine[1] = 999_999
    assert list(m.tokens) == toks(0, 2)
    s.free(blocks)
    s.check_integrity()


def test_commit_refuses_one_gpu_block_for_two_new_blocks_naming_it() -> None:
    s = make_store(gpu_blocks=8, host_blocks=None)
    keys = s.keys(toks(0, 2))
    (b,) = s.allocate(1)
    with pytest.raises(PlacementError, match=f"GPU block {b} already records"):
        s.commit(keys, [b, b], toks(0, 2))
    assert s.pool.ref_count(b) == 1 and s.h.placement.entry_of(b) is None  # the failed commit took nothing
    assert len(s.index) == 0
    s.check_integrity()


def test_commit_refuses_a_gpu_block_the_index_records_for_another_block() -> None:
    s = make_store(gpu_blocks=8, host_blocks=None)
    first = s.allocate(2)
    s.commit(s.keys(toks(0, 2)), first, toks(0, 2))
    other = s.allocate(2)
    recorded = s.h.placement.entry_of(first[1])
    with pytest.raises(PlacementError, match=f"GPU block {first[1]} already records"):
        s.commit(s.keys(toks(50, 2)), [other[0], first[1]], toks(50, 2))
    assert s.h.placement.entry_of(first[1]) is recorded and s.h.placement.entry_of(other[0]) is None
    assert [s.pool.ref_count(b) for b in (*first, *other)] == [2, 2, 1, 1]
    assert len(s.index) == 2 and s.index.match_keys(s.keys(toks(50, 2))).num_blocks == 0
    s.check_integrity()


def test_a_gpu_only_lookup_hashes_one_block_past_its_match_unless_keys_continue_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstore.store.tiered as store_mod

    hashed: list[int] = []
    real = store_mod.block_keys

    def counting(tokens: list[int], *args: object, **kw: object) -> list[bytes]:
        hashed.append(len(tokens) // LAYOUT.block_size)
        return real(tokens, *args, **kw)  # type: ignore[arg-type]

    s = make_store(gpu_blocks=8, host_blocks=None)
    prefill(s, toks(0, 2))
    monkeypatch.setattr(store_mod, "block_keys", counting)
    m = s.lookup(toks(0, 5))
    assert m.num_blocks == 2 and hashed == [1]  # no tier to probe: only the key that could continue the match
    keys = s.keys(toks(0, 4))
    blocks = s.allocate(2)
    s.commit(keys[:4], [m.entries[0].gpu_block, m.entries[1].gpu_block, *blocks])  # blocks 2-3 by key only
    hashed.clear()
    m = s.lookup(toks(0, 5))
    assert m.num_blocks == 4 and m.tiers == ("gpu",) * 4 and hashed == [1, 3]
    s.free(blocks)
    s.check_integrity()
