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


@pytest.fixture
def layout() -> KVLayout:
    """A tiny fp16 layout: 2 layers, 2 KV heads, head_dim 8, 4 tokens per block."""
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", model_id="test")


@pytest.fixture
def repo() -> Path:
    """The repository root."""
    return REPO
