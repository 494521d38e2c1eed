"""kvstore as vLLM's secondary offloading tier, driven by vLLM's real Scheduler and OffloadingConnector."""

from __future__ import annotations

from needs_vllm import require_vllm

require_vllm()

# ruff: noqa: E402 - the imports below need vLLM
from pathlib import Path
from typing import Any

import torch

import harness as h
from offload_setup import PROMPT, engine, kvstore_config, prompt_keys, scheduled, tier_of
from offload_worker import kv_bytes


def test_stored_prompt_is_loaded_from_kvstore_after_prefix_cache_reset(tmp_path: Path) -> None:
    w = engine(h.model_dir(tmp_path), kvstore_config(tmp_path))
    w.scheduler.add_request(h.make_request("a", PROMPT))
    first = w.run("a")
    assert first[0].num_scheduled_tokens == {"a": 50}
    tier = tier_of(w)
    assert [tier.store.contains(k) for k in prompt_keys(tier.layout)] == [True] * 3  # all three chunks reached kvstore

    assert w.scheduler.reset_prefix_cache(reset_connector=True)  # GPU prefix cache and vLLM's CPU tier
    w.scheduler.add_request(h.make_request("b", PROMPT))
    outs = w.run("b")
    assert scheduled(outs, "b") == [2]  # only the suffix after the 48 loaded tokens was computed
    assert w.loaded_kv_is("b", PROMPT) and len(w.loaded["b"]) == 3


def test_corrupt_block_in_kvstore_is_a_load_failure_and_recomputed(tmp_path: Path) -> None:
    config = kvstore_config(tmp_path, tiers=["lmdb"])  # no host copy to fall back on
    w = engine(h.model_dir(tmp_path), config)
    w.scheduler.add_request(h.make_request("a", PROMPT))
    w.run("a")
    tier = tier_of(w)
    disk = tier.store.tiers[0]
    keys = prompt_keys(tier.layout)
    def flip_one_byte(txn: Any) -> None:  # of the middle chunk's stored value
        value = bytearray(txn.get(keys[1], db=disk._blocks))
        value[len(value) // 2] ^= 0x01
        txn.put(keys[1], bytes(value), db=disk._blocks)

    disk._lmdb.txn(flip_one_byte)  # the tier's own write path (its LMDB environment is open in this process)

    assert w.scheduler.reset_prefix_cache(reset_connector=True)
    w.scheduler.add_request(h.make_request("b", PROMPT))
    outs = w.run("b")
    assert scheduled(outs, "b") == [34]  # chunk 0 loaded; chunk 1 (corrupt) and everything after it recomputed
    assert w.loaded_kv_is("b", PROMPT) and len(w.loaded["b"]) == 1
    s = disk.stats()
    assert s.corrupt_dropped == 1
    assert disk.contains(keys[1])  # request b stored its recomputed chunk again, a clean copy
    dest = torch.empty(tier.layout.bytes_per_block, dtype=torch.uint8)
    assert disk.get([keys[1]], [dest]) == [True]
    assert torch.equal(dest, kv_bytes(PROMPT[:32], tier.layout.bytes_per_block))


def test_tenants_never_see_each_others_blocks(tmp_path: Path) -> None:
    w = engine(h.model_dir(tmp_path), kvstore_config(tmp_path))
    w.scheduler.add_request(h.make_request("a", PROMPT, cache_salt="tenant-1"))
    w.run("a")
    tier = tier_of(w)
    assert [tier.store.contains(k) for k in prompt_keys(tier.layout, "tenant-1")] == [True] * 3
    assert [tier.store.contains(k) for k in prompt_keys(tier.layout, "tenant-2")] == [False] * 3

    assert w.scheduler.reset_prefix_cache(reset_connector=True)
    w.scheduler.add_request(h.make_request("b", PROMPT, cache_salt="tenant-2"))
    assert scheduled(w.run("b"), "b") == [50]  # another tenant: nothing loaded
    assert "b" not in w.loaded

    assert w.scheduler.reset_prefix_cache(reset_connector=True)
    w.scheduler.add_request(h.make_request("c", PROMPT, cache_salt="tenant-1"))
    assert scheduled(w.run("c"), "c") == [2]  # the same tenant again: its blocks load
    assert w.loaded_kv_is("c", PROMPT)


def test_two_models_never_see_each_others_blocks(tmp_path: Path) -> None:
    """Two models of the same shape share vLLM's block hashes; kvstore's keys (layout fingerprint) keep them apart."""
    config = kvstore_config(tmp_path)
    first = engine(h.model_dir(tmp_path, "model-one"), config)
    first.scheduler.add_request(h.make_request("a", PROMPT))
    first.run("a")
    one_layout = tier_of(first).layout
    first.scheduler.shutdown()  # closes the kvstore tiers (the LMDB environment is opened once per process)

    second = engine(h.model_dir(tmp_path, "model-two"), config)
    tier = tier_of(second)
    assert tier.layout.bytes_per_block == one_layout.bytes_per_block and tier.layout != one_layout
    second.scheduler.add_request(h.make_request("b", PROMPT))
    assert scheduled(second.run("b"), "b") == [50]
    assert "b" not in second.loaded
    assert [tier.store.contains(k) for k in prompt_keys(one_layout)] == [True] * 3  # model one's blocks are there
    second.scheduler.shutdown()
