"""kvstore as vLLM's secondary offloading tier, driven by vLLM's real Scheduler and OffloadingConnector."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import harness as h
import torch

from offload_worker import FakeOffloadWorker, kv_bytes

PROMPT = list(range(100, 150))  # 50 tokens: 3 full 16-token chunks and a 2-token tail


def kvstore_config(root: Path, **over: Any) -> Path:
    """An embedded kvstore config under ``root``: a small host tier in front of LMDB."""
    data: dict[str, Any] = {"connector": "embedded", "tiers": ["host", "lmdb"], "host": {"capacity": "1MiB"},
                            "disk": {"path": str(root / "lmdb"), "max_size": "16MiB", "sync": "always"}}
    data.update(over)
    path = root / "kvstore.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def offloading_connector(config: Path) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of adapter (1), as the README gives it."""
    return {"kv_connector": "KVStoreOffloadingConnector", "kv_connector_module_path": "connectors.vllm.offloading",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20,
                "secondary_tiers": [{"type": "KVStoreSecondaryTier", "module_path": "connectors.vllm.tiering",
                                     "kvstore_config": str(config)}]}}


def engine(model: Path, config: Path) -> FakeOffloadWorker:
    return FakeOffloadWorker(h.make_scheduler(h.vllm_config(model, offloading_connector(config))))


def tier_of(worker: FakeOffloadWorker) -> Any:
    return worker.scheduler.connector.kvstore_tiers[0]  # type: ignore[union-attr]


def test_stored_prompt_is_loaded_from_kvstore_after_prefix_cache_reset(tmp_path: Path) -> None:
    w = engine(h.model_dir(tmp_path), kvstore_config(tmp_path))
    w.scheduler.add_request(h.make_request("a", PROMPT))
    first = w.run("a")
    assert first[0].num_scheduled_tokens == {"a": 50}
    tier = tier_of(w)
    keys = tier.layout and [tier.store.contains(k) for k in _chain(tier, PROMPT, 3)]
    assert keys == [True, True, True]  # all three chunks reached kvstore

    assert w.scheduler.reset_prefix_cache(reset_connector=True)  # GPU prefix cache and vLLM's CPU tier
    w.scheduler.add_request(h.make_request("b", PROMPT))
    outs = w.run("b")
    scheduled = [o.num_scheduled_tokens["b"] for o in outs if "b" in o.num_scheduled_tokens]
    assert scheduled == [2]  # only the suffix after the 48 loaded tokens was computed
    assert w.loaded_kv_is("b", PROMPT) and len(w.loaded["b"]) == 3


def _chain(tier: Any, tokens: list[int], n: int) -> list[bytes]:
    from connectors.engine_keys import PromptKeys

    return PromptKeys(tier.layout, None).keys(tokens, n)


def test_corrupt_block_in_kvstore_is_a_load_failure_and_recomputed(tmp_path: Path) -> None:
    config = kvstore_config(tmp_path, tiers=["lmdb"])  # no host copy to fall back on
    w = engine(h.model_dir(tmp_path), config)
    w.scheduler.add_request(h.make_request("a", PROMPT))
    w.run("a")
    tier = tier_of(w)
    disk = tier.store.tiers[0]
    keys = _chain(tier, PROMPT, 3)
    with disk.env.begin(write=True) as txn:  # flip one byte of the middle chunk's stored value
        value = bytearray(txn.get(keys[1], db=disk._blocks))
        value[len(value) // 2] ^= 0x01
        txn.put(keys[1], bytes(value), db=disk._blocks)

    assert w.scheduler.reset_prefix_cache(reset_connector=True)
    w.scheduler.add_request(h.make_request("b", PROMPT))
    outs = w.run("b")
    scheduled = [o.num_scheduled_tokens["b"] for o in outs if "b" in o.num_scheduled_tokens]
    assert scheduled == [34]  # chunk 0 loaded; chunk 1 (corrupt) and everything after it recomputed
    assert w.loaded_kv_is("b", PROMPT) and len(w.loaded["b"]) == 1
    s = disk.stats()
    assert s.corrupt_dropped == 1
    assert disk.contains(keys[1])  # request b stored its recomputed chunk again, a clean copy
    dest = torch.empty(tier.layout.bytes_per_block, dtype=torch.uint8)
    assert disk.get([keys[1]], [dest]) == [True]
    assert torch.equal(dest, kv_bytes(PROMPT[:32], tier.layout.bytes_per_block))
