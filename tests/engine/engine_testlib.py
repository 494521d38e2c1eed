"""Helpers shared by the engine tests: tiny models and a harness that drives the runner by hand."""

from __future__ import annotations

import random

import torch

from engine.block_manager import BlockManager
from engine.config import ModelArch
from engine.kernels import select_backend
from engine.model import LlamaForCausalLM
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk
from engine.sequence import SequenceState
from engine.weights import build_model, init_random
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout


def tiny_model(num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0, device: str = "cpu",
               **kw: object) -> LlamaForCausalLM:
    """A seeded random fp32 model (on the CPU unless told otherwise)."""
    model = build_model(ModelArch.tiny(num_heads=num_heads, num_kv_heads=num_kv_heads, **kw), torch.float32,
                        device)
    init_random(model, seed)
    return model


class PagedHarness:
    """Drives the model runner by hand: allocate, run chunks, advance progress.

    The pool's free list is shuffled so block tables are never contiguous runs.
    """

    def __init__(self, model: LlamaForCausalLM, backend: str = "torch", block_size: int = 4,
                 num_blocks: int = 64) -> None:
        cfg = model.config
        device = model.lm_head.weight.device
        layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, "float32")
        self.pool = GPUBlockPool(layout, num_blocks, device)
        ids = list(range(num_blocks))
        random.Random(1234).shuffle(ids)
        self.pool._free.clear()
        self.pool._free.extend(ids)
        self.manager = BlockManager(self.pool)
        self.runner = ModelRunner(model, self.pool, select_backend(backend, device))

    def new_seq(self, tokens: list[int], rid: str = "s") -> SequenceState:
        """A sequence whose whole token list is ``tokens`` (treated as prompt)."""
        return SequenceState(rid, list(tokens), SamplingParams())

    def run(self, plan: list[tuple[SequenceState, int]]) -> list[torch.Tensor]:
        """Compute ``n`` more tokens of each listed sequence in one batch; all-token logits per entry."""
        chunks = []
        for seq, n in plan:
            assert self.manager.allocate_slots(seq, n)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
        logits = self.runner.run(chunks, all_logits=True)
        for seq, n in plan:
            seq.num_computed_tokens += n
        self.pool.check_integrity()
        return logits


def random_tokens(n: int, seed: int, vocab: int = 258) -> list[int]:
    """``n`` reproducible token ids below ``vocab``."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]
