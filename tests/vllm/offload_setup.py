"""Setting up vLLM with kvstore as its secondary offloading tier (adapter (1)), shared by tests and their subprocesses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

import harness as h
from connectors.engine_keys import PromptKeys
from offload_worker import FakeOffloadWorker

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


def prompt_keys(layout: Any, salt: str | None = None) -> list[bytes]:
    """kvstore's keys of PROMPT's three full chunks (kvstore's rules: layout fingerprint, salt, chain)."""
    return PromptKeys(layout, salt).keys(PROMPT, 3)


def engine(model: Path, config: Path) -> FakeOffloadWorker:
    """vLLM's scheduler with kvstore below its CPU tier (``config``: the kvstore YAML), and a fake worker."""
    return FakeOffloadWorker(h.make_scheduler(h.vllm_config(model, offloading_connector(config))))


def tier_of(worker: FakeOffloadWorker) -> Any:
    """The engine's :class:`~connectors.vllm.tiering.KVStoreSecondaryTier`."""
    return worker.scheduler.connector.kvstore_tiers[0]  # type: ignore[union-attr]


def scheduled(outs: list[Any], req_id: str) -> list[int]:
    """Tokens scheduled for ``req_id`` in each step that scheduled it."""
    return [o.num_scheduled_tokens[req_id] for o in outs if req_id in o.num_scheduled_tokens]
