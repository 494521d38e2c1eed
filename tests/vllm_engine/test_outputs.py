"""Output with kvstore equals output without, on a real vLLM engine, in every way a prefix reaches it.

Four engine processes over one daemon, each compared with vLLM alone (no
connector, same fp32 weights and threads) token for token:

1. ``first``: stores prompts, then loads them after vLLM's own cache is reset; a
   prompt with 31 blocks in vLLM's cache and 2 more in kvstore (the partial hit
   that used to write the loaded blocks at block-table positions [0, 1]); a
   multi-turn chat replayed with each turn's history half in vLLM's cache, half
   in kvstore; ``reset_connector``; tenants (``cache_salt``).
2. ``second``: a new process loads the prefix through the daemon; 8 concurrent
   requests on a shared 1,000-token prefix with a 44-block KV cache, so vLLM preempts.
3. ``third``: after a daemon restart, from LMDB, with one block damaged on disk
   (a load failure vLLM recomputes) and, as the control, one prompt whose blocks
   were replaced by another prompt's (valid checksums, wrong KV): its output must change.
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


@pytest.fixture(scope="module")
def site(model: Path) -> Any:
    s = rig.Site.start(model)
    yield s
    s.close()


@pytest.fixture(scope="module")
def first(model: Path, prompts: Prompts, site: rig.Site, reference: dict[str, Any]) -> dict[str, Any]:
    reset = "reset_prefix_cache"
    return rig.run_engine(model, [
        {"prompts": [prompts.long], "max_tokens": 12},                         # 0: computed, stored
        {"prompts": [prompts.short], "max_tokens": 4, "before": reset},        # 1: 31 blocks from kvstore
        {"prompts": [prompts.long], "max_tokens": 12},                         # 2: 31 local + 2 from kvstore
        {"prompts": prompts.turns, "max_tokens": 12},                          # 3: a chat, each turn stored
        {"prompts": prompts.turns, "max_tokens": 12, "before": reset},         # 4: history local + kvstore
        {"prompts": [prompts.long], "max_tokens": 12, "before": "reset_connector"},  # 5
        {"prompts": [prompts.other], "max_tokens": 12, "cache_salts": ["tenant-a"]},  # 6
        {"prompts": [prompts.other], "max_tokens": 12, "cache_salts": ["tenant-b"], "before": reset},  # 7
        {"prompts": [prompts.other], "max_tokens": 12, "cache_salts": ["tenant-a"], "before": reset},  # 8
    ], site.connector())


def test_a_prompt_loaded_from_kvstore_equals_vllm_alone(first: dict[str, Any], reference: dict[str, Any]) -> None:
    assert first["rounds"][0]["external_prefix_cache_hits"] == 0
    assert tokens(first, 0) == tokens(reference, 0)
    loaded = first["rounds"][1]
    assert loaded["prefix_cache_hits"] == 0 and loaded["external_prefix_cache_hits"] == 31 * BS


def test_vllms_own_cache_and_kvstore_both_hitting_equals_vllm_alone(first: dict[str, Any],
                                                                    reference: dict[str, Any]) -> None:
    rnd = first["rounds"][2]
    assert rnd["prefix_cache_hits"] == 31 * BS  # vLLM's cache holds the 31 blocks round 1 loaded
    assert rnd["external_prefix_cache_hits"] == 2 * BS  # kvstore the next 2 (blocks 31 and 32)
    assert tokens(first, 2) == tokens(reference, 0)


def test_a_multi_turn_chat_with_history_split_between_vllm_and_kvstore_equals_vllm_alone(
        first: dict[str, Any], reference: dict[str, Any], prompts: Prompts) -> None:
    assert tokens(first, 3) == tokens(reference, 1)
    replay = first["rounds"][4]
    # turn 1 comes whole from kvstore; turns 2 and 3 find the earlier turn in vLLM's cache, the rest in kvstore
    assert replay["external_prefix_cache_hits"] == sum(
        (len(t) - 1) // BS * BS - (len(p) // BS * BS if p else 0)
        for p, t in zip([None, *prompts.turns[:-1]], prompts.turns))
    assert replay["prefix_cache_hits"] > 0
    assert tokens(first, 4) == tokens(reference, 1)


def test_reset_connector_makes_the_engine_load_nothing_stored_before(first: dict[str, Any],
                                                                     reference: dict[str, Any]) -> None:
    rnd = first["rounds"][5]
    assert rnd["before_result"] is True
    assert rnd["external_prefix_cache_hits"] == 0 and rnd["prefix_cache_hits"] == 0
    assert tokens(first, 5) == tokens(reference, 0)


def test_two_cache_salts_never_share_a_block(first: dict[str, Any], reference: dict[str, Any],
                                             prompts: Prompts) -> None:
    assert first["rounds"][7]["external_prefix_cache_hits"] == 0  # tenant-b finds nothing of tenant-a's
    assert first["rounds"][8]["external_prefix_cache_hits"] == (len(prompts.other) - 1) // BS * BS
    assert tokens(first, 6) == tokens(first, 7) == tokens(first, 8) == tokens(reference, 3)


@pytest.fixture(scope="module")
def second(model: Path, prompts: Prompts, site: rig.Site, first: dict[str, Any]) -> dict[str, Any]:
    """A new vLLM process with a KV cache of 44 blocks: 8 requests of 33 blocks on a shared 31 cannot all fit."""
    return rig.run_engine(model, [
        {"prompts": [prompts.long], "max_tokens": 12},
        {"prompts": prompts.shared, "max_tokens": 24, "concurrent": True},
        {"prompts": prompts.shared, "max_tokens": 24, "concurrent": True, "before": "reset_prefix_cache"},
    ], site.connector(), num_gpu_blocks_override=44, max_model_len=1280)


def test_a_new_vllm_process_loads_the_prefix_through_the_daemon(second: dict[str, Any],
                                                                reference: dict[str, Any]) -> None:
    assert second["rounds"][0]["external_prefix_cache_hits"] == 33 * BS
    assert tokens(second, 0) == tokens(reference, 0)


def test_preempted_concurrent_requests_on_a_shared_prefix_equal_vllm_alone(second: dict[str, Any],
                                                                           reference: dict[str, Any]) -> None:
    assert second["rounds"][1]["num_preemptions"] + second["rounds"][2]["num_preemptions"] > 0
    assert second["rounds"][2]["external_prefix_cache_hits"] > 0
    assert tokens(second, 1) == tokens(reference, 2)
    assert tokens(second, 2) == tokens(reference, 2)


def vllm_layout(model: Path) -> KVLayout:
    """The layout the connector uses for ``model`` (the daemon's ``model:`` section, as a layout)."""
    section = rig.daemon_model(model)
    return KVLayout(**section)


@pytest.fixture(scope="module")
def third(model: Path, prompts: Prompts, site: rig.Site, second: dict[str, Any]) -> dict[str, Any]:
    layout = vllm_layout(model)
    swapped = rig.swap_blocks(site, layout, prompts.long, prompts.other)
    assert site.daemon is not None
    site.daemon.stop()
    rig.damage_block_on_disk(site, layout, prompts.long, 20)
    site.daemon = rig.start_daemon(site.daemon_config)
    record = rig.run_engine(model, [
        {"prompts": [prompts.long], "max_tokens": 12},
        {"prompts": [prompts.other], "max_tokens": 12},
    ], site.connector())
    record["swapped"] = swapped
    record["disk_hits"] = metric(site, "kvstore_hits_total", 'tier="disk"')
    record["corrupt"] = metric(site, "kvstore_corrupt_dropped_total", 'tier="disk"')
    return record


def test_after_a_daemon_restart_the_prefix_comes_from_disk_and_a_damaged_block_is_recomputed(
        third: dict[str, Any], reference: dict[str, Any]) -> None:
    assert third["rounds"][0]["external_prefix_cache_hits"] == 33 * BS  # the daemon lists all 33 blocks
    assert third["corrupt"] == 1  # block 20 failed its checksum: a load error, recomputed by vLLM
    assert third["disk_hits"] >= 20
    assert tokens(third, 0) == tokens(reference, 0)


def test_control_wrong_kv_served_as_a_hit_changes_the_output(third: dict[str, Any], reference: dict[str, Any],
                                                             prompts: Prompts) -> None:
    """The oracle can fail: blocks of another prompt under this prompt's keys are loaded and change the tokens."""
    assert third["swapped"] == (len(prompts.other) - 1) // BS
    assert third["rounds"][1]["external_prefix_cache_hits"] == third["swapped"] * BS
    assert tokens(third, 1) != tokens(reference, 3)
