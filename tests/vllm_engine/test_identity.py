"""What names a vLLM engine's blocks: the KV format and the weights, never the path (real engines, one daemon).

vLLM keeps every fp8 KV format in ``uint8`` tensors. An ``fp8_e4m3`` engine's
blocks loaded by an ``fp8_e5m2`` engine decode to other numbers, so the
e5m2 engine must be refused by the e4m3 engine's daemon, and the refusal must
name the field that differs and the section its own daemon needs.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

import rig
from kvstore.layout import KVLayout
from prompts import Prompts
from rig import tokens

BS = rig.BLOCK_SIZE


@pytest.fixture(scope="module")
def fp8_site(model: Path) -> Any:
    s = rig.Site.start(model, kv_cache_dtype="fp8_e4m3")
    yield s
    s.close()


def _loads_its_own_blocks(model: Path, prompts: Prompts, site: rig.Site, kv_cache_dtype: str) -> None:
    """A new engine process loads an fp8 engine's blocks and decodes as it did; the control: another
    prompt's blocks stored under a prompt's keys change that prompt's output (its own output, from the
    first process, computed under a cache salt, so its keys stay free)."""
    first = rig.run_engine(model, [
        {"prompts": [prompts.long], "max_tokens": 12},
        {"prompts": [prompts.other], "max_tokens": 12, "cache_salts": ["reference"]},
    ], site.connector(), kv_cache_dtype=kv_cache_dtype)
    layout = KVLayout(**rig.daemon_model(model, kv_cache_dtype=kv_cache_dtype))
    swapped = rig.swap_blocks(site, layout, prompts.long, prompts.other)
    second = rig.run_engine(model, [
        {"prompts": [prompts.long], "max_tokens": 12},
        {"prompts": [prompts.other], "max_tokens": 12},
    ], site.connector(), kv_cache_dtype=kv_cache_dtype)
    assert second["rounds"][0]["external_prefix_cache_hits"] == 33 * BS
    assert tokens(second, 0) == tokens(first, 0)
    assert second["rounds"][1]["external_prefix_cache_hits"] == swapped * BS  # the control
    assert tokens(second, 1) != tokens(first, 1)


def test_an_fp8_e4m3_engine_loads_its_own_blocks_and_another_prompts_change_the_output(model: Path, prompts: Prompts,
                                                            fp8_site: rig.Site) -> None:
    _loads_its_own_blocks(model, prompts, fp8_site, "fp8_e4m3")


def test_an_fp8_e5m2_engine_loads_its_own_blocks_from_its_own_daemon_and_another_prompts_change_the_output(model: Path, prompts: Prompts) -> None:
    site = rig.Site.start(model, kv_cache_dtype="fp8_e5m2")  # its own identity: the e4m3 daemon refuses it (below)
    try:
        _loads_its_own_blocks(model, prompts, site, "fp8_e5m2")
    finally:
        site.close()


def test_an_fp8_e5m2_engine_is_refused_by_an_fp8_e4m3_daemon_naming_the_format(model: Path, prompts: Prompts,
                                                                              fp8_site: rig.Site) -> None:
    with pytest.raises(AssertionError) as refused:
        rig.run_engine(model, [{"prompts": [prompts.long], "max_tokens": 2}], fp8_site.connector(),
                       kv_cache_dtype="fp8_e5m2")
    log = str(refused.value)
    assert "model_id" in log  # the field that differs
    assert "kv=fp8_e5m2" in log and "kv=fp8_e4m3" in log  # what the engine is, what the daemon serves


def test_the_same_weights_under_another_path_share_blocks(model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "smollm2-copy"
    shutil.copytree(model, copy)
    assert rig.daemon_model(copy) == rig.daemon_model(model)
    (copy / "config.json").write_text((copy / "config.json").read_text().replace('"rms_norm_eps": 9.9',
                                                                               '"rms_norm_eps": 1.9'))
    assert rig.daemon_model(copy)["model_id"] != rig.daemon_model(model)["model_id"]  # other weights, other blocks
