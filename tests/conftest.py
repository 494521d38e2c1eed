"""Shared fixtures: small layouts and repository paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.layout import KVLayout

REPO = Path(__file__).resolve().parent.parent

# tests/sglang runs in its own environment (.venv-sglang, `make venv-sglang`), where SGLang 0.5.23 is
# installed without touching this one's pins; `make test` runs it there after this suite. Naming the
# folder on the command line (`pytest tests/sglang`) still collects it.
collect_ignore = ["sglang"]


@pytest.fixture
def layout() -> KVLayout:
    """A tiny fp16 layout: 2 layers, 2 KV heads, head_dim 8, 4 tokens per block."""
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", model_id="test")


@pytest.fixture
def repo() -> Path:
    """The repository root."""
    return REPO
