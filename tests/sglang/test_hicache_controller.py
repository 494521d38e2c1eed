"""kvstore driven by SGLang's own ``HiCacheController`` on the CPU (its backup, prefetch and I/O threads).

The test plays the scheduler's part only where the radix tree would: it
hands the controller host pages to back up (``write_storage``, with the page
hashes HiRadixCache computes with ``get_storage_hash_str``), asks it to
prefetch a prompt (``prefetch``), gives the storage hit host memory as the
tree cache does (``prefetch_buffer``) and reads the controller's acks.
Everything between — hashing the prompt, ``batch_exists``, the page reads
and writes, the consecutive-hit accounting — is SGLang's code calling
kvstore's backend, loaded through ``--hicache-storage-backend dynamic``.
"""

from __future__ import annotations

from sglang_stubs import require_sglang

require_sglang()

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

from sglanglib import EXTRA, PAGE, device_pool, fill_pages, host_pool, pages_at, write_kvstore_config
from connectors.sglang.backend import KVStoreHiCacheStorage

ACK_WAIT_S = 60.0
PROMPT = list(range(1000, 1000 + 4 * PAGE))  # four full pages


@contextmanager
def controller(config: Path, **extra: Any) -> Iterator[HiCacheController]:
    """A HiCacheController of one TP rank with kvstore attached, on the CPU; detached (backend closed) on exit."""
    kv = device_pool()
    host = host_pool(kv)
    allocator = PagedTokenToKVPoolAllocator(kv.size, PAGE, torch.float16, "cpu", kv, False)
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        cc = HiCacheController(
            allocator, host, PAGE, tp_group=None, load_cache_event=threading.Event(), io_backend="direct",
            storage_backend="dynamic", prefetch_threshold=PAGE, model_name="sglang-test",
            storage_backend_extra_config={**EXTRA, "kvstore_config": str(config), **extra},
        )
        try:
            assert isinstance(cc.storage_backend, KVStoreHiCacheStorage)
            yield cc
        finally:
            cc.detach_storage_backend()


def back_up(cc: HiCacheController, tokens: list[int], seed: int) -> list[torch.Tensor]:
    """Write the prompt's pages through the controller's backup thread; returns the pages written."""
    src = fill_pages(cc.mem_pool_host, len(tokens) // PAGE, seed=seed)
    op_id = cc.write_storage(src, tokens, hash_value=get_storage_hash_str(tokens, None, page_size=PAGE))
    ack = cc.ack_backup_queue.get(timeout=ACK_WAIT_S)
    assert ack.id == op_id and ack.completed_tokens == len(tokens)
    return pages_at(cc.mem_pool_host, src)


def prefetch(cc: HiCacheController, tokens: list[int]) -> tuple[PrefetchOperation, int, torch.Tensor | None]:
    """Ask the controller to prefetch ``tokens``; returns the operation, tokens it loaded, and their host indices."""
    op = cc.prefetch("req-1", tokens)
    hit = cc.prefetch_hit_queue.get(timeout=ACK_WAIT_S)
    assert hit is op
    if op.storage_hit_count == 0:
        return op, 0, None
    op.host_indices = cc.mem_pool_host.alloc(op.storage_hit_count)
    cc.prefetch_buffer.put(op)
    loaded = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=ACK_WAIT_S)
        if ack.completed_req:
            return op, loaded, op.host_indices
        loaded = max(loaded, ack.completed_tokens or 0)


@pytest.mark.parametrize("interface_v1", [1, 0], ids=["by-host-index", "flat-pages"])
def test_a_prompt_backed_up_by_one_server_is_prefetched_by_the_next(tmp_path: Path, interface_v1: int) -> None:
    config = write_kvstore_config(tmp_path)
    with controller(config, interface_v1=interface_v1) as cc:
        written = back_up(cc, PROMPT, seed=4)
    with controller(config, interface_v1=interface_v1) as cc:  # a restarted server: empty host pool
        op, loaded, dst = prefetch(cc, PROMPT + [7, 8])  # a trailing partial page is never stored
        assert op.storage_hit_count == len(PROMPT) and loaded == len(PROMPT)
        assert dst is not None
        assert all(torch.equal(a, b) for a, b in zip(pages_at(cc.mem_pool_host, dst), written))
        op, loaded, _ = prefetch(cc, [5] + PROMPT[1:])  # another first token: every page hash differs
        assert op.storage_hit_count == 0 and loaded == 0


def test_a_corrupt_page_ends_the_loaded_prefix_before_it(tmp_path: Path) -> None:
    config = write_kvstore_config(tmp_path)
    with controller(config, interface_v1=1) as cc:
        written = back_up(cc, PROMPT, seed=6)
        backend = cc.storage_backend
        assert isinstance(backend, KVStoreHiCacheStorage)
        damaged = backend.keys_of(get_storage_hash_str(PROMPT, None, page_size=PAGE))[2]
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        value = bytearray(txn.get(damaged))
        value[-1] ^= 0x10
        txn.put(damaged, bytes(value))
    env.close()
    with controller(config, interface_v1=1) as cc:
        op, loaded, dst = prefetch(cc, PROMPT)
        assert op.storage_hit_count == len(PROMPT)  # existence is a key probe; the bytes are checked on read
        assert loaded == 2 * PAGE  # SGLang keeps the pages before the damaged one and recomputes the rest
        assert dst is not None
        assert all(torch.equal(a, b) for a, b in zip(pages_at(cc.mem_pool_host, dst)[:2], written[:2]))
        op, loaded, _ = prefetch(cc, PROMPT)  # the damaged value was dropped: now a plain miss at page 2
        assert op.storage_hit_count == 2 * PAGE and loaded == 2 * PAGE
