"""The built-in engine's command-line flags, shared by ``kvstore generate`` and ``kvstore engine serve``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Add ``--model``, ``--backend``, ``--dtype``, ``--device``, ``--block-size``, ``--num-blocks``, ``--seed``."""
    p.add_argument("--model", default="default", metavar="PATH",
                   help="'default' (SmolLM2-135M-Instruct), a .gguf file, a checkpoint directory, or 'builtin' "
                   "(the tiny random model) (default: default)")
    p.add_argument("--backend", choices=["auto", "triton", "torch"], default="auto",
                   help="attention kernels: auto = Triton on CUDA, torch on the CPU (default: auto)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="weights and KV cache dtype; auto = bfloat16 on CUDA, float32 on the CPU (default: auto)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda:0 (default: CUDA if available)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks in the GPU block pool (default: 512)")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in model's random weights (default: 0)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` the flags of :func:`add_engine_args` describe (raises ``ValueError`` on bad values)."""
    from engine import EngineConfig

    return EngineConfig(block_size=args.block_size, num_gpu_blocks=args.num_blocks, backend=args.backend,
                        dtype=args.dtype, device=args.device, seed=args.seed)
