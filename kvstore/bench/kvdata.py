"""KV-like block contents for bandwidth and compression measurements (never all zeros).

Real K and V activations are smooth along the token axis within a channel
and have a few channels with a large offset (the well-known K outliers).
Random bytes would make every codec look useless and zeros would make it
look magic; this generator sits between, and the suite says it is
synthetic:

    x[layer, kv, token, head, dim] = offset[layer, kv, head, dim]
                                     + scale[dim] * AR1_token(rho=0.9)

stored in the layout's dtype (fp16 by default).
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore.layout import KVLayout

RHO = 0.9
"""Correlation of consecutive tokens in one channel."""


def kv_like_blocks(layout: KVLayout, count: int, seed: int) -> torch.Tensor:
    """``count`` distinct blocks of KV-like values as one ``uint8`` tensor ``[count, bytes_per_block]``."""
    rng = np.random.default_rng(seed)
    L, _, T, H, D = layout.block_shape
    offset = rng.normal(0.0, 0.5, size=(L, 2, 1, H, D)).astype(np.float32)
    offset[..., rng.choice(D, size=max(1, D // 32), replace=False)] *= 12.0  # outlier channels
    scale = rng.uniform(0.2, 1.5, size=D).astype(np.float32)
    out = torch.empty((count, layout.bytes_per_block), dtype=torch.uint8)
    state = rng.normal(0.0, 1.0, size=(L, 2, H, D)).astype(np.float32)
    innovation = np.sqrt(1 - RHO * RHO)
    for b in range(count):
        noise = rng.normal(0.0, innovation, size=(T, L, 2, H, D)).astype(np.float32)
        series = np.empty((L, 2, T, H, D), dtype=np.float32)
        for t in range(T):
            state = RHO * state + noise[t]
            series[:, :, t] = state
        block = torch.from_numpy(offset + scale * series).to(layout.torch_dtype)
        out[b] = block.reshape(-1).view(torch.uint8)
    return out
