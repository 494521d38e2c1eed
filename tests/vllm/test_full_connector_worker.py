"""The worker side of kvstore's full connector on CPU tensors, against an in-process kvstore host tier."""

from __future__ import annotations

from needs_vllm import require_vllm

require_vllm()

# ruff: noqa: E402 - the imports below need vLLM

import pytest
import torch

from connectors.engine_keys import PromptKeys, engine_layout
from connectors.engine_store import EngineBlockStore
from connectors.vllm.connector_meta import NULL, BlockTransfer, KVStoreConnectorMetadata
from connectors.vllm.connector_worker import KVStoreConnectorWorker
from kvstore.tiers.host.tier import HostTier

LAYERS = ["l0", "l1", "l2"]
NUM_BLOCKS, BS, HEADS, DIM = 8, 4, 2, 8
PAGE = 2 * BS * HEADS * DIM * 2  # K and V, fp16
TOKENS = list(range(1, 4 * BS + 1))


def rig(block_axis_first: bool = False,
        layer_groups: list[int] | None = None) -> tuple[KVStoreConnectorWorker, dict[str, torch.Tensor], list[bytes]]:
    layout = engine_layout("vllm-blocks", "test", "float16", BS, PAGE * len(LAYERS))
    store = EngineBlockStore(layout, [HostTier(layout, 64 * layout.bytes_per_block)])
    worker = KVStoreConnectorWorker(store, layout, LAYERS, NUM_BLOCKS, PAGE, layer_groups=layer_groups)
    shape = (NUM_BLOCKS, 2, BS, HEADS, DIM) if block_axis_first else (2, NUM_BLOCKS, BS, HEADS, DIM)
    caches = {n: torch.randn(shape).to(torch.float16) for n in LAYERS}
    worker.register_kv_caches(caches)
    return worker, caches, PromptKeys(layout, None).keys(TOKENS, 4)


def block(caches: dict[str, torch.Tensor], layer: str, b: int, axis: int) -> torch.Tensor:
    return caches[layer].select(axis, b).clone()


@pytest.mark.parametrize("block_axis_first", [False, True])
def test_saved_blocks_load_back_bit_for_bit_even_for_layers_save_kv_layer_skipped(block_axis_first: bool) -> None:
    worker, caches, keys = rig(block_axis_first)
    axis = 0 if block_axis_first else 1
    want = {(n, b): block(caches, n, b, axis) for n in LAYERS for b in (2, 5)}
    worker.start_load_kv(KVStoreConnectorMetadata(saves=[BlockTransfer("a", ((2, 5),), tuple(keys[:2]))]))
    worker.save_kv_layer("l0", caches["l0"])
    worker.save_kv_layer("l2", caches["l2"])  # l1's attention never called it: wait_for_save copies it itself
    worker.wait_for_save()
    assert worker.save_queue.wait_idle(30)  # the background writer stored the saves
    assert worker.store.contains_prefix(keys) == 2

    for t in caches.values():
        t.zero_()
    worker.start_load_kv(KVStoreConnectorMetadata(loads=[BlockTransfer("b", ((6, 1),), tuple(keys[:2]))]))
    for n in LAYERS:
        worker.wait_for_layer_load(n)
    worker.wait_for_save()
    assert worker.save_queue.wait_idle(30)  # the background writer stored the saves
    assert worker.get_block_ids_with_load_errors() == set()
    for n in LAYERS:
        assert torch.equal(block(caches, n, 6, axis), want[(n, 2)]) and torch.equal(block(caches, n, 1, axis), want[(n, 5)])
        assert not block(caches, n, 0, axis).any()  # nothing else was written


def test_a_block_kvstore_does_not_return_is_a_load_error_and_the_others_load() -> None:
    worker, caches, keys = rig()
    worker.start_load_kv(KVStoreConnectorMetadata(saves=[BlockTransfer("a", ((0,),), (keys[0],))]))
    worker.wait_for_save()
    assert worker.save_queue.wait_idle(30)  # the background writer stored the saves
    want = block(caches, "l1", 0, 1)
    worker.start_load_kv(KVStoreConnectorMetadata(loads=[BlockTransfer("b", ((3, 4),), (keys[0], keys[1]))]))
    for n in LAYERS:
        worker.wait_for_layer_load(n)  # returns although block 4 never arrives
    assert worker.get_block_ids_with_load_errors() == {4}
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    assert torch.equal(block(caches, "l1", 3, 1), want)


def test_hybrid_groups_each_layer_goes_to_its_groups_block_and_a_null_position_is_not_written() -> None:
    """Layers l0, l2 in a full-attention group (0), l1 in a sliding-window group (1): a position before the
    window has no block in group 1 (NULL). Saves read each layer from its group's block; asynchronous loads
    (a hybrid model's kind) finish within ``start_load_kv`` and are reported once, a failed one as failed."""
    worker, caches, keys = rig(layer_groups=[0, 1, 0])
    want = {"l0": block(caches, "l0", 2, 1), "l1": block(caches, "l1", 6, 1), "l2": block(caches, "l2", 2, 1)}
    want1 = {n: block(caches, n, 3 if n != "l1" else 7, 1) for n in LAYERS}
    worker.start_load_kv(KVStoreConnectorMetadata(saves=[BlockTransfer("a", ((2, 3), (6, 7)), tuple(keys[:2]))]))
    worker.wait_for_save()
    assert worker.save_queue.wait_idle(30)  # the background writer stored the saves
    for t in caches.values():
        t.zero_()
    worker.start_load_kv(KVStoreConnectorMetadata(async_loads=[BlockTransfer("b", ((4, 5), (NULL, 1)), tuple(keys[:2]))]))
    assert worker.take_finished_loads() == ({"b"}, set())
    assert worker.take_finished_loads() == (set(), set())  # reported once
    assert torch.equal(block(caches, "l0", 4, 1), want["l0"]) and torch.equal(block(caches, "l2", 4, 1), want["l2"])
    assert torch.equal(block(caches, "l1", 1, 1), want1["l1"]) and torch.equal(block(caches, "l0", 5, 1), want1["l0"])
    written = {(n, b) for n in LAYERS for b in range(NUM_BLOCKS) if block(caches, n, b, 1).any()}
    assert written == {("l0", 4), ("l2", 4), ("l0", 5), ("l2", 5), ("l1", 1)}  # l1 had no block at position 0
    assert worker.get_block_ids_with_load_errors() == set()

    worker.start_load_kv(KVStoreConnectorMetadata(async_loads=[BlockTransfer("c", ((4, 5), (0, 1)), (keys[0], keys[3]))]))
    assert worker.take_finished_loads() == ({"c"}, {"c"})  # a block missing: the whole request fails
    assert worker.get_block_ids_with_load_errors() == set()  # never as block ids: vLLM refuses those for several groups


def test_on_cuda_each_layer_is_announced_only_after_its_copies_are_fenced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch (stream sync before a layer's event) driven on CPU with a fake stream."""
    worker, caches, keys = rig()
    worker.start_load_kv(KVStoreConnectorMetadata(saves=[BlockTransfer("a", ((0,),), (keys[0],))]))
    worker.wait_for_save()
    assert worker.save_queue.wait_idle(30)  # the background writer stored the saves
    assert worker.cache is not None
    worker.cache.on_cuda = True
    seen: list[list[bool]] = []

    class FakeStream:
        def synchronize(self) -> None:
            assert worker._load is not None
            seen.append([ev.is_set() for ev in worker._load.layer_done])

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    worker.start_load_kv(KVStoreConnectorMetadata(loads=[BlockTransfer("b", ((3,),), (keys[0],))]))
    for n in LAYERS:
        worker.wait_for_layer_load(n)
    assert seen == [[False, False, False], [True, False, False], [True, True, False]]


def test_a_kv_cache_without_a_block_axis_is_refused_naming_the_layer() -> None:
    layout = engine_layout("vllm-blocks", "test", "float16", BS, PAGE * len(LAYERS))
    worker = KVStoreConnectorWorker(EngineBlockStore(layout, []), layout, LAYERS, NUM_BLOCKS, PAGE)
    caches = {n: torch.zeros((2, BS, NUM_BLOCKS + 1, HEADS, DIM), dtype=torch.float16) for n in LAYERS}
    with pytest.raises(ValueError, match=r"KV cache of layer l0 has shape \(2, 4, 9, 2, 8\): no block axis of size 8"):
        worker.register_kv_caches(caches)
