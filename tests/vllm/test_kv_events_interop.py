"""kvstore's KV events and vLLM's are one wire format: each side decodes the other's bytes, and kvstore's
subscriber follows vLLM's own ``ZmqEventPublisher``, replay included."""

from __future__ import annotations

from needs_vllm import require_vllm

require_vllm()

# ruff: noqa: E402 - the imports below need vLLM
import time
from pathlib import Path

import msgspec
from vllm.distributed import kv_events as vk

from kvstore.events import StoreEvent
from kvstore.route.index import PrefixHit, RouterIndex
from kvstore.route.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from kvstore.route.subscriber import EventSubscriber, ReplicaEndpoints
from kvstore.route.translate import batch_of, kv_events

K = [bytes([i]) * 32 for i in range(4)]


def test_vllm_decodes_a_batch_kvstore_published() -> None:
    events = [StoreEvent("stored", K[0], "gpu"), StoreEvent("stored", K[1], "gpu"), StoreEvent("spilled", K[0], "host"),
              StoreEvent("evicted", K[0], "gpu"), StoreEvent("dropped", K[1], "index")]
    data = encode_batch(batch_of(kv_events(events, 16) + [AllBlocksCleared()], ts=12.5))
    got = msgspec.msgpack.Decoder(vk.KVEventBatch).decode(data)  # what vLLM's consumers run
    assert got.ts == 12.5
    assert [type(e).__name__ for e in got.events] == ["BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved",
                                                      "AllBlocksCleared"]
    first = got.events[0]
    assert isinstance(first, vk.BlockStored)
    assert (first.block_hashes, first.medium, first.block_size, first.token_ids) == ([K[0], K[1]], vk.MEDIUM_GPU, 16, [])
    assert got.events[1].medium == vk.MEDIUM_CPU
    assert (got.events[2].block_hashes, got.events[2].medium) == ([K[0]], vk.MEDIUM_GPU)
    assert got.events[3].medium is None


def test_kvstore_decodes_a_batch_vllm_encoded() -> None:
    batch = vk.KVEventBatch(ts=3.0, data_parallel_rank=1, events=[
        vk.BlockStored(block_hashes=[K[2], 99], parent_block_hash=K[1], token_ids=list(range(32)), block_size=16,
                       lora_id=None, medium=vk.MEDIUM_GPU, lora_name=None, group_idx=0, kv_cache_spec_kind="full"),
        vk.BlockRemoved(block_hashes=[99], medium=vk.MEDIUM_CPU),
        vk.AllBlocksCleared(),
    ])
    got = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert (got.ts, got.data_parallel_rank) == (3.0, 1)
    stored, removed, cleared = got.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.group_idx,
            stored.kv_cache_spec_kind) == ([K[2], 99], K[1], list(range(32)), 0, "full")
    assert (removed.block_hashes, removed.medium) == ([99], "CPU")
    ours = encode_batch(got)
    if vk.BlockStored.__struct_fields__ == BlockStored.__struct_fields__:
        # vLLM 0.33: byte-identical, kvstore's structs are vLLM's shape field for field
        assert ours == msgspec.msgpack.Encoder().encode(batch)
    # every line (0.32 lacks BlockStored.lookahead_token_ids, which kvstore leaves out when unset): vLLM's own
    # decoder reads kvstore's bytes back to the batch it encoded
    assert msgspec.msgpack.Decoder(vk.KVEventBatch).decode(ours) == batch


def _stored(hashes: list[bytes | int]) -> vk.BlockStored:
    return vk.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                          medium=vk.MEDIUM_GPU, lora_name=None)


def test_the_router_follows_vllms_publisher_and_replays_from_it(tmp_path: Path) -> None:
    ep, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    pub = vk.ZmqEventPublisher(0, endpoint=ep, replay_endpoint=replay)
    pub.publish(vk.KVEventBatch(ts=time.time(), events=[_stored([1, 2])]))  # seq 0, before anyone listens: lost
    # vLLM's publisher sends from its own thread; wait until seq 0 is on the wire (and in its replay buffer)
    # before the subscriber joins, or the subscriber could receive it live and see no gap.
    pub._event_queue.join()
    sub = EventSubscriber(RouterIndex(), {"vllm-0": ReplicaEndpoints(ep, replay)})
    sub.start()
    feed = sub.feeds["vllm-0"]
    deadline = time.monotonic() + 10
    try:
        # vLLM's publisher cannot say when a subscriber has joined: publish until one batch lands; the
        # first seen reveals the gap before it, which the subscriber replays from vLLM's buffer.
        while feed.last_seq is None:
            assert time.monotonic() < deadline, "no batch from vLLM's publisher reached the subscriber"
            pub.publish(vk.KVEventBatch(ts=time.time(), events=[_stored([3])]))
            poll_until = time.monotonic() + 0.05
            while feed.last_seq is None and time.monotonic() < poll_until:
                time.sleep(0.005)
        assert (feed.gaps, feed.replays, feed.full_reports, feed.bad) == (1, 1, 0, {})
        with sub.lock:
            assert sub.index.cached_prefix([1, 2, 3])["vllm-0"] == PrefixHit(3, {"gpu": 3})
    finally:
        sub.close()
        pub.shutdown()
