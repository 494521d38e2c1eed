"""The seam the connector plugs into: a replacement KV cache manager and the per-layer hook."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from engine import LLM, EngineConfig, ModelArch, SamplingParams
from engine.block_manager import BlockManager
from engine.sequence import SequenceState
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout

CONFIG = EngineConfig(block_size=4, num_gpu_blocks=32, max_num_batched_tokens=64, dtype="float32")


class PrefixReuseManager(BlockManager):
    """A toy prefix cache: finished sequences leave their full prompt blocks behind, keyed by tokens.

    It stands in for the connector: ``admit`` hands over cached blocks,
    ``before_layer`` records the layer order, ``free`` keeps blocks alive.
    """

    def __init__(self, pool: GPUBlockPool) -> None:
        super().__init__(pool)
        self.cache: dict[tuple[int, ...], list[int]] = {}
        self.layer_calls: list[int] = []

    def admit(self, seq: SequenceState) -> None:
        super().admit(seq)
        bs = self.block_size
        usable = (seq.num_prompt_tokens - 1) // bs  # leave at least one token to compute
        for n in range(usable, 0, -1):
            blocks = self.cache.get(tuple(seq.prompt_token_ids[: n * bs]))
            if blocks is not None:
                seq.block_table = self.pool.fork(blocks)
                seq.num_cached_tokens = seq.num_computed_tokens = n * bs
                return

    def before_layer(self, seqs: Sequence[SequenceState]) -> Callable[[int], None] | None:
        return self.layer_calls.append

    def free(self, seq: SequenceState) -> None:
        full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.block_size
        for n in range(1, full + 1):
            key = tuple(seq.prompt_token_ids[: n * self.block_size])
            if key not in self.cache:
                self.cache[key] = self.pool.fork(seq.block_table[:n])
        super().free(seq)


def test_cached_prefix_is_skipped_and_output_unchanged() -> None:
    prompt = [256, *range(40, 53)]  # 14 tokens: 3 full blocks + 2
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    (plain,) = LLM(config=CONFIG).generate([prompt], params)
    llm = LLM(config=CONFIG, block_manager_factory=PrefixReuseManager)
    (first,) = llm.generate([prompt], params)
    (second,) = llm.generate([prompt], params)
    assert first.token_ids == second.token_ids == plain.token_ids
    assert (first.metrics.num_cached_tokens, first.metrics.num_prefill_tokens_computed) == (0, 14)
    assert (second.metrics.num_cached_tokens, second.metrics.num_prefill_tokens_computed) == (12, 2)
    llm.pool.check_integrity()


def test_before_layer_runs_for_every_layer_in_order_each_step() -> None:
    llm = LLM(config=CONFIG, block_manager_factory=PrefixReuseManager)
    (out,) = llm.generate([[256, 1, 2]], SamplingParams(max_tokens=3, ignore_eos=True))
    layers = llm.arch.num_layers
    steps = 3  # one prefill, two decodes
    assert llm.block_manager.layer_calls == list(range(layers)) * steps
    assert out.metrics.time_to_first_token is not None and out.metrics.time_to_first_token > 0


def test_engine_can_share_an_existing_pool() -> None:
    cfg = ModelArch.tiny()
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, CONFIG.block_size, "float32")
    pool = GPUBlockPool(layout, 20, CONFIG.torch_device())
    llm = LLM(config=CONFIG, pool=pool)
    assert llm.pool is pool
    (out,) = llm.generate([[256, 5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out.token_ids) == 2 and pool.num_free == 20
    wrong = GPUBlockPool(KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, "float32"), 4,
                         CONFIG.torch_device())
    with pytest.raises(ValueError, match="does not match the engine"):
        LLM(config=CONFIG, pool=wrong)
