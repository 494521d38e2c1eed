"""The shape of one model's KV cache, and the identity that keeps models apart.

A *block* holds the K and V vectors of ``block_size`` consecutive tokens for
every layer. It is stored block-major, so one block is one contiguous range of
bytes (all layers, K then V) and moves between tiers as a single copy::

    block  = [num_layers, 2, block_size, num_kv_heads, head_dim]
                          ^ 0 = K, 1 = V
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # torch is imported only where a tensor dtype is asked for (CLI start-up stays light)
    import torch

DTypeName = Literal["float16", "bfloat16", "float32"]

_ITEMSIZES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}


def auto_dtype(device_type: str) -> DTypeName:
    """The KV dtype ``auto`` stands for on a device of ``device_type``: bfloat16 on CUDA, float32 elsewhere.

    The engine's default (``EngineConfig(dtype="auto")``) and a config's
    ``model.dtype: auto`` both resolve here, so a daemon and the engines on
    its machine agree on the layout without either naming a dtype.
    """
    return "bfloat16" if device_type == "cuda" else "float32"


@dataclass(frozen=True)
class KVLayout:
    """Layout of a paged KV cache.

    ``model_id`` names the weights; together with the shape and dtype it forms
    the :attr:`fingerprint` mixed into every block key, so two models (or one
    model in two dtypes) never share blocks.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: DTypeName = "float16"
    model_id: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in _ITEMSIZES:
            raise ValueError(
                f"KVLayout.dtype must be one of {sorted(_ITEMSIZES)}, got {self.dtype!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the cache tensors."""
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def elements_per_block(self) -> int:
        """Number of elements in one block."""
        n = 1
        for d in self.block_shape:
            n *= d
        return n

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block (all layers, K and V)."""
        return self.elements_per_block * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers."""
        return self.bytes_per_block // self.block_size

    @property
    def fingerprint(self) -> bytes:
        """16-byte identity of (model id, shape, dtype); equal layouts give equal bytes."""
        text = (
            f"kvstore-layout-v1|model={self.model_id}|layers={self.num_layers}"
            f"|kv_heads={self.num_kv_heads}|head_dim={self.head_dim}"
            f"|block_size={self.block_size}|dtype={self.dtype}"
        )
        return hashlib.blake2b(text.encode(), digest_size=16).digest()
