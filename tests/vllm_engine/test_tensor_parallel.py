"""Tensor parallelism (TP=2) through the full connector on a real vLLM: each rank stores and loads its own shard.

A tiny Llama with 4 K/V heads (Hugging Face-initialised random weights, so the output depends on the KV
cache; SmolLM2's tokenizer; fp32) runs with ``tensor_parallel_size=2`` on this CPU, one OpenMP thread per
rank (``VLLM_CPU_OMP_THREADS_BIND=0|1``). Both ranks share one daemon (one shard layout, each rank's keys
its own, :mod:`connectors.vllm.shards`). A new engine process loads every block from both ranks' shards and
decodes as vLLM alone does; with one rank's shard of a block deleted, the scheduler counts only the blocks
before it (each rank must have its shard), and the output is still vLLM alone's. The control: both ranks'
shards of one prompt stored under another prompt's keys change that prompt's output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import rig
from connectors.engine_keys import PromptKeys
from connectors.vllm.shards import Shard, all_shards
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.client.tier import DaemonTier
from kvstore.layout import KVLayout
from prompts import Prompts
from rig import tokens

BS = rig.BLOCK_SIZE
TP = 2
ENGINE: dict[str, Any] = {"tensor_parallel_size": TP, "distributed_executor_backend": "mp"}
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
MISSING = 10
"""The block whose rank-1 shard is deleted before the last engine runs."""


@pytest.fixture(scope="module")
def tp_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama, 8 query and 4 K/V heads of 32, random weights, saved like a checkpoint."""
    return rig.random_checkpoint("Llama", tmp_path_factory.mktemp("llama-4kv"), model, num_attention_heads=8,
                                 num_key_value_heads=4)


@pytest.fixture(scope="module")
def runs(tp_model: Path, prompts: Prompts) -> dict[str, Any]:
    site = rig.Site.start(tp_model, tp=TP)
    try:
        rnd = [{"prompts": [prompts.long], "max_tokens": 12}]
        control = [{"prompts": [prompts.other], "max_tokens": 12}]
        out: dict[str, Any] = {"alone": rig.run_engine(tp_model, rnd + control, env=ENV, **ENGINE)}
        out["first"] = rig.run_engine(tp_model, rnd, site.connector(), env=ENV, **ENGINE)
        out["second"] = rig.run_engine(tp_model, rnd, site.connector(), env=ENV, **ENGINE)  # a new process
        layout = KVLayout(**rig.daemon_model(tp_model, tp=TP))
        out["stored"] = _shards_stored(site, layout, prompts.long)
        out["swapped"] = rig.swap_blocks(site, layout, prompts.long, prompts.other, all_shards(TP))
        _delete_shard(site, layout, prompts.long, Shard(1, TP), MISSING)
        out["third"] = rig.run_engine(tp_model, rnd + control, site.connector(), env=ENV, **ENGINE)
        return out
    finally:
        site.close()


def _tier(site: rig.Site, layout: KVLayout) -> DaemonTier:
    assert site.daemon is not None
    client = DaemonClient(layout, socket_path=site.daemon.socket_path)
    client.connect(10)
    return DaemonTier(layout, client)


def _shards_stored(site: rig.Site, layout: KVLayout, prompt: list[int]) -> list[int]:
    """How many of ``prompt``'s blocks each rank's shard has in the daemon."""
    n = (len(prompt) - 1) // BS
    keys = PromptKeys(layout, None).keys(prompt, n)
    tier = _tier(site, layout)
    try:
        return [tier.contains_prefix(Shard(r, TP).keys(keys)) for r in range(TP)]
    finally:
        tier.close()


def _delete_shard(site: rig.Site, layout: KVLayout, prompt: list[int], shard: Shard, block: int) -> None:
    keys = PromptKeys(layout, None).keys(prompt, block + 1)
    tier = _tier(site, layout)
    try:
        assert tier.delete(shard.keys(keys[block:])) == 1
    finally:
        tier.close()


def test_each_rank_stores_its_own_shard_and_a_new_process_loads_both_equal_to_vllm_alone(
        runs: dict[str, Any], prompts: Prompts) -> None:
    n = (len(prompts.long) - 1) // BS
    assert runs["stored"] == [n, n]  # both ranks' shards of every full block, under their own keys
    assert runs["first"]["rounds"][0]["external_prefix_cache_hits"] == 0
    assert runs["second"]["rounds"][0]["external_prefix_cache_hits"] == n * BS
    assert tokens(runs["second"], 0) == tokens(runs["alone"], 0) == tokens(runs["first"], 0)


def test_a_rank_missing_its_shard_makes_the_block_recomputed_on_every_rank(runs: dict[str, Any]) -> None:
    assert runs["third"]["rounds"][0]["external_prefix_cache_hits"] == MISSING * BS  # only the blocks before it
    assert tokens(runs["third"], 0) == tokens(runs["alone"], 0)


def test_control_another_prompts_shards_change_the_output(runs: dict[str, Any]) -> None:
    assert runs["third"]["rounds"][1]["external_prefix_cache_hits"] == runs["swapped"] * BS
    assert tokens(runs["third"], 1) != tokens(runs["alone"], 1)


def test_the_shard_keys_of_one_rank_are_the_plain_keys_and_ranks_never_share_one() -> None:
    keys = [bytes([i]) * 32 for i in range(4)]
    assert Shard().keys(keys) == keys  # TP=1 engines keep the keys they always had
    a, b = Shard(0, 2).keys(keys), Shard(1, 2).keys(keys)
    assert not set(a) & set(b) and not set(a) & set(keys) and len(set(a)) == 4
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        Shard(2, 2)
