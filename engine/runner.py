"""Runs one scheduled step through the model: flat inputs, attention metadata, logits."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.attention import AttentionMetadata, ChunkSpec, PagedAttention
from engine.kernels import AttentionBackend
from engine.model import LlamaForCausalLM
from engine.scheduler import ScheduledChunk
from kvstore.store.gpu_pool import GPUBlockPool


class ModelRunner:
    """Owns nothing but references: the model, the block pool and the attention backend."""

    def __init__(self, model: LlamaForCausalLM, pool: GPUBlockPool, backend: AttentionBackend) -> None:
        cfg = model.config
        layout = pool.layout
        if (layout.num_layers, layout.num_kv_heads, layout.head_dim) != (cfg.num_layers, cfg.num_kv_heads,
                                                                          cfg.head_dim):
            raise ValueError(f"pool layout {layout} does not match the model "
                             f"({cfg.num_layers} layers, {cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim})")
        self.model = model
        self.pool = pool
        self.backend = backend
        self.scale = cfg.head_dim ** -0.5
        self.windows = cfg.layer_windows

    def run(self, chunks: Sequence[ScheduledChunk], before_layer: Callable[[int], None] | None = None,
            all_logits: bool = False) -> list[torch.Tensor]:
        """Compute ``chunks`` (writes their KV into the pool) and return logits per chunk, in the given order.

        Each entry is ``[vocab]`` logits of the chunk's last token, or, with
        ``all_logits``, ``[num_tokens, vocab]`` for every token of the chunk
        (the tests compare those with a dense forward pass).
        """
        # Decodes first: the attention kernels split the batch there (see engine.attention).
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].num_tokens != 1)
        ordered = [chunks[i] for i in order]
        device = self.pool.device
        ids: list[int] = []
        positions: list[int] = []
        specs: list[ChunkSpec] = []
        for c in ordered:
            tokens = c.seq.all_token_ids[c.start:c.start + c.num_tokens]
            if len(tokens) != c.num_tokens:
                raise ValueError(f"chunk of {c.seq.request_id!r} asks for positions [{c.start}, "
                                 f"{c.start + c.num_tokens}) of a {c.seq.num_tokens}-token sequence")
            ids.extend(tokens)
            positions.extend(range(c.start, c.start + c.num_tokens))
            specs.append(ChunkSpec(c.seq.block_table, c.start, c.num_tokens))
        metadata = AttentionMetadata.build(specs, self.pool.layout.block_size, device)
        ctx = PagedAttention(self.pool, self.backend, metadata, self.scale, self.windows)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=device),
                            torch.tensor(positions, dtype=torch.long, device=device), ctx, before_layer)
        ends = torch.tensor([c.num_tokens for c in ordered]).cumsum(0).tolist()
        if all_logits:
            logits = self.model.compute_logits(hidden)
            per_ordered = [logits[end - c.num_tokens:end] for c, end in zip(ordered, ends)]
        else:
            rows = torch.tensor([end - 1 for end in ends], device=device)
            per_ordered = list(self.model.compute_logits(hidden[rows]))
        result: list[torch.Tensor] = [torch.empty(0)] * len(chunks)
        for slot, i in enumerate(order):
            result[i] = per_ordered[slot]
        return result
