"""MLA (DeepSeek-V2-style latent attention) through the full connector on a real vLLM.

vLLM caches one latent vector per token and layer for MLA (``kv_lora_rank`` compressed K/V plus the rope
key, ``MLAAttentionSpec``), not K and V per head; kvstore stores whatever page vLLM hands it, so the same
connector serves it. The model is a tiny DeepSeek-V2 with Hugging Face-initialised random weights (so the
output depends on the KV cache) and SmolLM2's tokenizer. vLLM's CPU MLA backends take bf16 weights only
(not fp32); their block size depends on the CPU (:func:`mla_block_size`).
The control stores another prompt's blocks under this prompt's keys and the output changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import rig
from kvstore.layout import KVLayout
from prompts import Prompts
from rig import tokens



def mla_block_size() -> int:
    """The block size vLLM's CPU MLA runs with on this machine: with AMX tiles its AMX_MLA backend takes multiples
    of 32, as its other CPU attention does; without them its CPU_MLA decode kernel compiles for 16 only and vLLM
    sets 16 whatever the engine asks (``vllm/platforms/cpu.py``). The daemon's layout must be the one vLLM runs."""
    return rig.BLOCK_SIZE if torch.cpu._is_amx_tile_supported() else 16


BS = mla_block_size()
DTYPE = "bfloat16"
"""The CPU MLA backend packs its weights for bf16 / fp16 only."""
ENGINE = {"block_size": BS, "dtype": DTYPE}


@pytest.fixture(scope="module")
def mla_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer DeepSeek-V2 (MLA: kv_lora_rank 512, rope 64, dense MLPs) with random weights, saved like a checkpoint."""
    return rig.random_checkpoint(
        "DeepseekV2", tmp_path_factory.mktemp("deepseek-v2-tiny"), model, moe_intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2)


@pytest.fixture(scope="module")
def runs(mla_model: Path, prompts: Prompts) -> dict[str, Any]:
    site = rig.Site.start(mla_model, block_size=BS, dtype=DTYPE)
    try:
        rounds = [{"prompts": [prompts.long], "max_tokens": 12}, {"prompts": [prompts.other], "max_tokens": 12}]
        out: dict[str, Any] = {"alone": rig.run_engine(mla_model, rounds, **ENGINE)}
        out["first"] = rig.run_engine(mla_model, rounds[:1], site.connector(), **ENGINE)
        out["second"] = rig.run_engine(mla_model, rounds[:1], site.connector(), **ENGINE)  # a new process
        layout = KVLayout(**rig.daemon_model(mla_model, block_size=BS, dtype=DTYPE))
        out["swapped"] = rig.swap_blocks(site, layout, prompts.long, prompts.other)
        out["control"] = rig.run_engine(mla_model, rounds[1:], site.connector(), **ENGINE)
        return out
    finally:
        site.close()


def test_mla_blocks_loaded_by_a_new_process_equal_vllm_alone(runs: dict[str, Any], prompts: Prompts) -> None:
    rnd = runs["second"]["rounds"][0]
    assert rnd["external_prefix_cache_hits"] == (len(prompts.long) - 1) // BS * BS  # every full block, from kvstore
    assert runs["first"]["rounds"][0]["external_prefix_cache_hits"] == 0
    assert tokens(runs["second"], 0) == tokens(runs["alone"], 0) == tokens(runs["first"], 0)


def test_control_another_prompts_mla_blocks_change_the_output(runs: dict[str, Any], prompts: Prompts) -> None:
    assert runs["control"]["rounds"][0]["external_prefix_cache_hits"] == runs["swapped"] * BS
    assert tokens(runs["control"], 0) != tokens(runs["alone"], 1)
