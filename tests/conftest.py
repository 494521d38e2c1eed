"""Shared fixtures: small layouts and repository paths."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvstore.layout import KVLayout

REPO = Path(__file__).resolve().parent.parent



def _has_vllm() -> bool:
    """Whether the real vLLM is importable (not the namespace package ``tests/vllm`` makes of itself on sys.path)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


# tests/vllm needs vLLM, which lives in its own environment (.venv-vllm, `make venv-vllm`; vLLM's pins
# would override the project's). `make test` runs it there, after this suite; a run in an
# environment without vLLM does not collect it.
collect_ignore = [] if _has_vllm() else ["vllm"]


@pytest.fixture
def layout() -> KVLayout:
    """A tiny fp16 layout: 2 layers, 2 KV heads, head_dim 8, 4 tokens per block."""
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", model_id="test")


@pytest.fixture
def repo() -> Path:
    """The repository root."""
    return REPO
