"""Helpers for connector tests: engines with and without kvstore, and logit capture."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from connectors.embedded import EmbeddedConnector
from engine import LLM, EngineConfig, SamplingParams
from engine.config import ModelArch
from kvstore.config import parse_config

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def engine_config(gpu_blocks: int = 64) -> EngineConfig:
    """Tiny fp32 engine; small batches so prompts prefill in several chunks.

    The CPU with the torch backend unless ``KVSTORE_TEST_DEVICE`` / ``KVSTORE_TEST_BACKEND``
    say otherwise: ``benchmarks/gpu_check.sh`` runs this suite on CUDA with both backends.
    """
    return EngineConfig(block_size=BLOCK, num_gpu_blocks=gpu_blocks, max_num_batched_tokens=64, max_num_seqs=8,
                        device=os.environ.get("KVSTORE_TEST_DEVICE", "cpu"),
                        backend=os.environ.get("KVSTORE_TEST_BACKEND", "torch"),  # type: ignore[arg-type]  # checked by EngineConfig
                        dtype="float32", seed=0)


def kv_config(root: Path, *, host_blocks: int = 64, block_bytes: int = 2048, **over: Any) -> Any:
    """A kvstore config with tiers under ``root``; ``over`` sets top-level sections or policy fields."""
    data: dict[str, Any] = {
        "tiers": over.pop("tiers", ["host", "lmdb"]),
        "host": {"capacity": host_blocks * block_bytes},
        "disk": {"path": str(root / "lmdb"), "max_size": "64MiB", "sync": "always", "codec": over.pop("codec", "none")},
        "policy": {"write": over.pop("write", "write_through"), "prefetch": over.pop("prefetch", "wait_complete")},
    }
    data.update(over)
    return parse_config(data, "test")


def make_llm(root: Path | None = None, gpu_blocks: int = 64, preemption: str = "recompute",
             arch: ModelArch | None = None, **kv: Any) -> LLM:
    """An engine with an embedded connector (``root=None``: no connector at all, the recompute oracle);
    ``arch``: the random model's shape (default :meth:`ModelArch.tiny`)."""
    if root is None:
        return LLM(config=engine_config(gpu_blocks), arch=arch)
    conn = EmbeddedConnector(kv_config(root, **kv))
    return LLM(config=engine_config(gpu_blocks), arch=arch, connector=conn,
               preemption=preemption)  # type: ignore[arg-type]


def embedded(llm: LLM) -> EmbeddedConnector:
    """The engine's embedded connector (tests reach its store to check internals)."""
    assert isinstance(llm.connector, EmbeddedConnector), llm.connector
    return llm.connector


def capture_logits(llm: LLM) -> dict[str, torch.Tensor]:
    """Record the logits each request's first sampled token was drawn from."""
    seen: dict[str, torch.Tensor] = {}
    original = llm.sampler.sample

    def sample(seq, row):  # noqa: ANN001, ANN202
        seen.setdefault(seq.request_id, row.detach().clone())
        return original(seq, row)

    llm.sampler.sample = sample  # type: ignore[method-assign]
    return seen


def prompt(seed: int, n: int) -> list[int]:
    """``n`` reproducible token ids of the tiny model's vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()
