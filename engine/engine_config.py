"""Settings of the engine itself (memory, batching, kernels), separate from the model's shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from engine.kernels import BackendName
from kvstore.layout import auto_dtype

DTypeName = Literal["auto", "float32", "float16", "bfloat16"]


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    - ``block_size``: tokens per KV block in the pool.
    - ``num_gpu_blocks``: blocks in the pool; with ``max_num_batched_tokens``
      this bounds concurrency (a tiny pool forces preemption).
    - ``max_num_batched_tokens``: per-step token budget; longer prompts are
      prefilled in chunks of at most this size.
    - ``max_num_seqs``: most sequences in the running batch.
    - ``backend``: ``auto`` (Triton on CUDA, torch elsewhere), ``triton`` or ``torch``.
    - ``dtype``: weights and KV cache; ``auto`` is bfloat16 on CUDA, float32 on the CPU.
    - ``device``: ``None`` picks CUDA when available.
    - ``seed``: seeds random weights (built-in model) and unseeded sampling.
    """

    block_size: int = 16
    num_gpu_blocks: int = 512
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    backend: BackendName = "auto"
    dtype: DTypeName = "auto"
    device: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.backend not in get_args(BackendName):
            raise ValueError(f"EngineConfig.backend {self.backend!r} is unknown; "
                             f"choose one of {list(get_args(BackendName))}")
        if self.dtype not in get_args(DTypeName):
            raise ValueError(f"EngineConfig.dtype {self.dtype!r} is unknown; choose one of {list(get_args(DTypeName))}")

    def torch_device(self) -> torch.device:
        """The device to run on."""
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def kv_dtype_name(self) -> Literal["float32", "float16", "bfloat16"]:
        """The concrete dtype name after resolving ``auto``."""
        if self.dtype == "auto":
            return auto_dtype(self.torch_device().type)
        return self.dtype
