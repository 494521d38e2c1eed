"""Paged attention for one batch: the metadata the kernels need, and the per-layer call.

A batch is a flat run of tokens from several sequences. Sequences with exactly
one new token (decodes) come first, then prefill chunks, so one kernel of each
kind covers its rows::

    rows   | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |
           '-- decode --' '------ prefill ------'
    prefill query_start_loc = [0, 4, 6]   (relative to the first prefill row)

Every token's K/V is written to its slot *before* attention runs, so a query
attends over its own key like any cached one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kernels import AttentionBackend
from kvstore.store.gpu_pool import GPUBlockPool


@dataclass(frozen=True)
class ChunkSpec:
    """One sequence's part of a batch: its block table and the positions ``[start, start + length)`` to compute."""

    block_table: Sequence[int]
    start: int
    length: int


@dataclass(frozen=True)
class AttentionMetadata:
    """Device tensors describing a batch; built once per step, shared by every layer."""

    slot_mapping: torch.Tensor          # [T] int64, slot of each new token
    num_decode_tokens: int              # rows [0, num_decode_tokens) are decodes
    decode_block_tables: torch.Tensor   # [Bd, max_blocks] int32
    decode_seq_lens: torch.Tensor       # [Bd] int32, tokens attended (including the new one)
    prefill_block_tables: torch.Tensor  # [Bp, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [Bp + 1] int32
    prefill_seq_lens: torch.Tensor      # [Bp] int32
    max_prefill_query_len: int

    @classmethod
    def build(cls, chunks: Sequence[ChunkSpec], block_size: int, device: torch.device) -> AttentionMetadata:
        """Metadata for ``chunks``, which must list single-token chunks first."""
        num_decodes = 0
        while num_decodes < len(chunks) and chunks[num_decodes].length == 1:
            num_decodes += 1
        if any(c.length != 1 for c in chunks[:num_decodes]) or any(c.length == 1 for c in chunks[num_decodes:]):
            raise ValueError("single-token chunks must come first in a batch")
        slots: list[int] = []
        for c in chunks:
            needed = -(-(c.start + c.length) // block_size)
            if needed > len(c.block_table):
                raise ValueError(f"block table of {len(c.block_table)} blocks cannot hold "
                                 f"{c.start + c.length} tokens at block size {block_size}")
            table = c.block_table
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(c.start, c.start + c.length))
        decodes, prefills = chunks[:num_decodes], chunks[num_decodes:]
        qsl = [0]
        for c in prefills:
            qsl.append(qsl[-1] + c.length)

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decode_tokens=num_decodes,
            decode_block_tables=_padded_tables(decodes, device),
            decode_seq_lens=i32([c.start + 1 for c in decodes]),
            prefill_block_tables=_padded_tables(prefills, device),
            prefill_query_start_loc=i32(qsl),
            prefill_seq_lens=i32([c.start + c.length for c in prefills]),
            max_prefill_query_len=max((c.length for c in prefills), default=0),
        )


def _padded_tables(chunks: Sequence[ChunkSpec], device: torch.device) -> torch.Tensor:
    """Block tables as one int32 matrix; rows are padded with 0, never read past ``seq_len``."""
    width = max((len(c.block_table) for c in chunks), default=0)
    rows = [list(c.block_table) + [0] * (width - len(c.block_table)) for c in chunks]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(chunks), width)


class PagedAttention:
    """The model's :class:`~engine.model.AttentionContext` for a batch over the block pool.

    ``attend`` writes the layer's new K/V into the pool (changes the pool's
    bytes at ``slot_mapping`` only) and returns the attention output.
    """

    def __init__(self, pool: GPUBlockPool, backend: AttentionBackend, metadata: AttentionMetadata,
                 scale: float, windows: Sequence[int] = ()) -> None:
        """``windows``: each layer's sliding window (0 or absent: full attention)."""
        self.pool = pool
        self.backend = backend
        self.metadata = metadata
        self.scale = scale
        self.windows = tuple(windows)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write ``k, v`` of the new tokens into layer ``layer``'s blocks, then attend; ``[T, H, D]``."""
        md = self.metadata
        k_cache, v_cache = self.pool.layer_kv(layer)
        self.backend.write_kv(k, v, k_cache, v_cache, md.slot_mapping)
        nd = md.num_decode_tokens
        window = self.windows[layer] if layer < len(self.windows) else 0
        parts = []
        if nd:
            parts.append(self.backend.paged_decode(q[:nd], k_cache, v_cache, md.decode_block_tables,
                                                   md.decode_seq_lens, self.scale, window=window))
        if q.shape[0] > nd:
            parts.append(self.backend.paged_prefill(q[nd:], k_cache, v_cache, md.prefill_block_tables,
                                                    md.prefill_query_start_loc, md.prefill_seq_lens, self.scale,
                                                    max_query_len=md.max_prefill_query_len, window=window))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
