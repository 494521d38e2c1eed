"""Hybrid KV caches through the full connector on a real vLLM: Gemma 3-style alternating windows, and Mamba.

**Gemma 3-style**: two sliding-window layers (window 64: two blocks) and one full-attention layer. The
connector declares vLLM's hybrid allocator (``SupportsHMA``), so vLLM keeps three KV cache groups with
their own block tables instead of turning the allocator off (which halved the KV cache). A kvstore block
carries one position of all three layers; each layer's slice goes to its own group's block, and a sliding
group's positions before the window (vLLM's null block) are not written. A new engine process loads every
full block of the prompt and decodes as vLLM alone does (fp32, random weights, so the output depends on
the KV cache); the control stores that prompt's blocks under another prompt's keys and that prompt's
output changes. A block damaged on disk fails the load, which vLLM takes for the whole request (it
refuses block-level failures with several groups): it recomputes it, equal to vLLM alone, and kvstore
offers that request nothing more.

**Mamba hybrid** (Granite 4.0-H style: Mamba2 and attention layers): its state is not per-token K/V, so
the connector refuses it at start with a message naming the layer kind, where vLLM used to refuse with
"Failed to promote local KV cache specs to one unified type".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import rig
from kvstore.layout import KVLayout
from prompts import Prompts
from rig import tokens

BS = rig.BLOCK_SIZE
WINDOW = 64


@pytest.fixture(scope="module")
def gemma_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer Gemma 3 text model (sliding, sliding, full), 4 query and 2 K/V heads of 64, random weights."""
    return rig.random_checkpoint("Gemma3", tmp_path_factory.mktemp("gemma3-hybrid"), model,
                                 config_class="Gemma3TextConfig", num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
                                 layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                 query_pre_attn_scalar=64)


@pytest.fixture(scope="module")
def runs(gemma_model: Path, prompts: Prompts) -> dict[str, Any]:
    site = rig.Site.start(gemma_model)
    try:
        rounds = [{"prompts": [prompts.long], "max_tokens": 12}, {"prompts": [prompts.other], "max_tokens": 12}]
        out: dict[str, Any] = {"alone": rig.run_engine(gemma_model, rounds)}
        out["first"] = rig.run_engine(gemma_model, rounds[:1], site.connector())
        layout = KVLayout(**rig.daemon_model(gemma_model))
        out["swapped"] = rig.swap_blocks(site, layout, prompts.long, prompts.other)
        out["second"] = rig.run_engine(gemma_model, rounds, site.connector())  # a new process
        # A block the daemon lists but cannot return (damaged on disk): a hybrid model's load fails as a whole
        # request's, which vLLM recomputes, and kvstore offers that request nothing more (no second failed load).
        assert site.daemon is not None
        site.daemon.stop()
        rig.damage_block_on_disk(site, layout, prompts.long, 20)
        site.daemon = rig.start_daemon(site.daemon_config)
        out["damaged"] = rig.run_engine(gemma_model, rounds[:1], site.connector())
        out["corrupt"] = rig.metric(site, "kvstore_corrupt_dropped_total", 'tier="disk"')
        return out
    finally:
        site.close()


def test_an_alternating_window_model_keeps_its_kv_cache_groups_and_loads_equal_to_vllm_alone(
        runs: dict[str, Any], prompts: Prompts) -> None:
    assert "Turning off hybrid kv cache manager" not in runs["first"]["log"]
    second = runs["second"]["rounds"][0]
    assert second["external_prefix_cache_hits"] == (len(prompts.long) - 1) // BS * BS  # every full block
    assert runs["first"]["rounds"][0]["external_prefix_cache_hits"] == 0
    assert tokens(runs["second"], 0) == tokens(runs["alone"], 0) == tokens(runs["first"], 0)


def test_control_another_prompts_blocks_in_a_hybrid_model_change_the_output(runs: dict[str, Any]) -> None:
    assert runs["second"]["rounds"][1]["external_prefix_cache_hits"] == runs["swapped"] * BS
    assert tokens(runs["second"], 1) != tokens(runs["alone"], 1)


def test_a_failed_hybrid_load_is_recomputed_equal_to_vllm_alone(runs: dict[str, Any], prompts: Prompts) -> None:
    rnd, n = runs["damaged"]["rounds"][0], (len(prompts.long) - 1) // BS
    assert runs["corrupt"] == 1  # block 20 failed its checksum: the load failed
    assert rnd["external_prefix_cache_queries"] == 2 * len(prompts.long)  # vLLM asked again after the failure
    # the first ask offered every block (the failed load); the second got none: without that, the blocks
    # before the damaged one (deleted by then) would have been offered and loaded again
    assert rnd["external_prefix_cache_hits"] == n * BS
    assert rnd["outputs"][0]["num_cached_tokens"] == 0  # recomputed whole
    assert tokens(runs["damaged"], 0) == tokens(runs["alone"], 0)


def test_a_mamba_hybrid_is_refused_at_start_naming_its_layer_kind(model: Path, tmp_path: Path,
                                                                  prompts: Prompts) -> None:
    granite = rig.random_checkpoint(
        "GraniteMoeHybrid", tmp_path / "granite-h", model, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=32,
        mamba_d_state=16, mamba_n_groups=1, mamba_expand=1, mamba_chunk_size=64, num_local_experts=0,
        shared_intermediate_size=512, position_embedding_type="rope")
    engine_config = tmp_path / "engine.yaml"
    engine_config.write_text(yaml.safe_dump({"connector": "sidecar",
                                             "daemon": {"socket_path": str(tmp_path / "none.sock")}}))
    with pytest.raises(AssertionError) as err:
        rig.run_engine(granite, [{"prompts": [prompts.other], "max_tokens": 4}], rig.connector_config(engine_config),
                       enable_prefix_caching=False)
    assert "KVStoreConnector stores attention K/V blocks only" in str(err.value)
    assert "MambaSpec" in str(err.value)
    assert "Failed to promote" not in str(err.value)
