"""Checkpoint identity: independent of the path, sensitive to the weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from engine import LLM, EngineConfig
from engine.config import ModelArch
from engine.model_id import checkpoint_identity
from engine.weights import build_model, init_random, save_checkpoint


def _checkpoint(path: Path, seed: int) -> Path:
    model = build_model(ModelArch.tiny(), torch.float32, "cpu")
    init_random(model, seed)
    save_checkpoint(model, path)
    return path


def test_identity_follows_weights_not_path(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "ckpt", seed=1)
    copy = tmp_path / "elsewhere" / "ckpt"
    shutil.copytree(a, copy)
    assert checkpoint_identity(a) == checkpoint_identity(copy)
    b = _checkpoint(tmp_path / "other" / "ckpt", seed=2)  # same name and shapes, other weights
    assert checkpoint_identity(b) != checkpoint_identity(a)


def test_engine_layout_uses_the_identity(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "ckpt", seed=1)
    cfg = EngineConfig(block_size=4, num_gpu_blocks=16, device="cpu")
    llm = LLM(path, config=cfg)
    assert llm.pool.layout.model_id == checkpoint_identity(path)
    assert LLM(path, config=cfg, model_id="pinned").pool.layout.model_id == "pinned"
