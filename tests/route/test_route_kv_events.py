"""KV events: vLLM's msgpack shape, the store's events translated, and every kind of bad input named."""

from __future__ import annotations

import msgspec
import pytest

from kvstore.events import StoreEvent
from kvstore.route.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFormatError,
    KVEventBatch,
    decode_batch,
    encode_batch,
    medium_of,
    tier_of,
)
from kvstore.route.translate import kv_events, report_events

K = [bytes([i]) * 32 for i in range(6)]


def _stored(keys: list[bytes], medium: str | None) -> BlockStored:
    return BlockStored(block_hashes=list(keys), parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium=medium, lora_name=None)


def test_batch_is_an_array_of_tagged_maps_as_vllm_encodes_it() -> None:
    batch = KVEventBatch(ts=1.5, events=[_stored([K[0]], "GPU"), BlockRemoved([7], "CPU"), AllBlocksCleared()],
                         data_parallel_rank=0)
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0] == {"type": "BlockStored", "block_hashes": [K[0]], "parent_block_hash": None, "token_ids": [],
                         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}
    assert raw[1][2] == {"type": "AllBlocksCleared"}
    assert decode_batch(encode_batch(batch)) == batch


def test_fields_a_later_vllm_adds_are_ignored() -> None:
    data = msgspec.msgpack.encode([2.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU",
                                          "some_future_field": 3}]])
    assert decode_batch(data).events == [BlockRemoved([1], "GPU")]


@pytest.mark.parametrize(("data", "says"), [
    (b"\xc1", "malformed msgpack"),
    (msgspec.msgpack.encode(["yesterday", []]), "Expected `float`, got `str` - at `$[0]`"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockEvicted", "block_hashes": []}]]), "Invalid value 'BlockEvicted'"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": "abc", "medium": None}]]),
     "Expected `array`, got `str` - at `$[1][0].block_hashes`"),
    (msgspec.msgpack.encode({"ts": 1.0}), "Expected `array`, got `object`"),
])
def test_bad_bytes_raise_event_format_error_saying_what_was_wrong(data: bytes, says: str) -> None:
    with pytest.raises(EventFormatError) as info:
        decode_batch(data)
    assert says in str(info.value)


def test_mediums_map_both_ways_and_an_unknown_one_is_named() -> None:
    assert [medium_of(t) for t in ("gpu", "host", "disk", "remote")] == ["GPU", "CPU", "STORAGE", "REMOTE"]
    assert [tier_of(m) for m in ("GPU", "CPU", "STORAGE", "REMOTE", None, "host")] == \
        ["gpu", "host", "disk", "remote", "gpu", "host"]
    with pytest.raises(EventFormatError, match="unknown medium 'NVME'"):
        tier_of("NVME")
    with pytest.raises(ValueError, match="no medium for tier 'index'"):
        medium_of("index")


def test_store_events_become_kv_events_in_order_with_runs_merged() -> None:
    events = [StoreEvent("stored", K[0], "gpu"), StoreEvent("stored", K[1], "gpu"), StoreEvent("spilled", K[0], "host"),
              StoreEvent("evicted", K[0], "gpu"), StoreEvent("corrupt", K[2], "disk"), StoreEvent("dropped", K[3], "index"),
              StoreEvent("dropped", K[4], "index"), StoreEvent("loaded", K[5], "gpu"), StoreEvent("stored", K[5], "remote")]
    assert kv_events(events, 16) == [
        _stored([K[0], K[1]], "GPU"), _stored([K[0]], "CPU"), BlockRemoved([K[0]], "GPU"),
        BlockRemoved([K[2]], "STORAGE"), BlockRemoved([K[3], K[4]], None), _stored([K[5]], "GPU"),
        _stored([K[5]], "REMOTE"),
    ]


def test_full_report_clears_then_lists_each_tier() -> None:
    assert report_events({"gpu": [K[0]], "host": [], "disk": [K[0], K[1]]}, 16) == [
        AllBlocksCleared(), _stored([K[0]], "GPU"), _stored([K[0], K[1]], "STORAGE")]
