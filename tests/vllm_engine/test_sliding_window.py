"""Sliding-window attention (Mistral-style: every layer attends to the last 64 tokens) through the full connector.

vLLM keeps such a model in one ``SlidingWindowSpec`` KV cache group and hands its null block for the
positions before the window, which nothing reads. kvstore counts the whole stored prefix as cached (vLLM
computes none of it) but loads only the blocks inside the window: never the null block (before, 29 of 31
loaded blocks were written into it). A tiny Mistral with Hugging Face-initialised random weights, fp32;
a new engine process decodes equal to vLLM alone. The control: another prompt's blocks stored under a
prompt's keys change that prompt's output, so the window's blocks really are loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import rig
from kvstore.layout import KVLayout
from prompts import Prompts
from rig import metric, tokens

BS = rig.BLOCK_SIZE
WINDOW = 64
"""Tokens each layer attends to: two blocks."""


@pytest.fixture(scope="module")
def swa_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Mistral, 8 query and 4 K/V heads of 32, every layer windowed to 64 tokens, random weights."""
    return rig.random_checkpoint("Mistral", tmp_path_factory.mktemp("mistral-swa"), model, num_attention_heads=8,
                                 num_key_value_heads=4, head_dim=32, sliding_window=WINDOW)


def blocks_read(site: rig.Site) -> float:
    return sum(metric(site, "kvstore_hits_total", f'tier="{t}"') for t in ("host", "disk"))


@pytest.fixture(scope="module")
def runs(swa_model: Path, prompts: Prompts) -> dict[str, Any]:
    site = rig.Site.start(swa_model)
    try:
        rnd = [{"prompts": [prompts.long], "max_tokens": 12}]
        control = [{"prompts": [prompts.other], "max_tokens": 12}]
        out: dict[str, Any] = {"alone": rig.run_engine(swa_model, rnd + control)}
        out["first"] = rig.run_engine(swa_model, rnd, site.connector())
        out["swapped"] = rig.swap_blocks(site, KVLayout(**rig.daemon_model(swa_model)), prompts.long, prompts.other)
        before = blocks_read(site)
        out["second"] = rig.run_engine(swa_model, rnd + control, site.connector())  # a new process
        out["read"] = blocks_read(site) - before
        return out
    finally:
        site.close()


def test_a_sliding_window_model_loads_only_the_window_and_equals_vllm_alone(runs: dict[str, Any],
                                                                          prompts: Prompts) -> None:
    n = (len(prompts.long) - 1) // BS
    assert runs["second"]["rounds"][0]["external_prefix_cache_hits"] == n * BS  # vLLM computes none of the prefix
    assert 0 < runs["read"] <= 2 * (WINDOW // BS + 1)  # each prompt: only the blocks its window reaches
    assert tokens(runs["second"], 0) == tokens(runs["alone"], 0) == tokens(runs["first"], 0)


def test_control_another_prompts_window_blocks_change_the_output(runs: dict[str, Any]) -> None:
    assert runs["second"]["rounds"][1]["external_prefix_cache_hits"] == runs["swapped"] * BS
    assert tokens(runs["second"], 1) != tokens(runs["alone"], 1)
