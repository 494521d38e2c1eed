"""The paged engine's logits equal a dense causal forward pass (no cache) in fp32."""

from __future__ import annotations

import pytest
import torch

from engine.model import dense_logits

from engine_testlib import PagedHarness, random_tokens, tiny_model

ATOL = 2e-5

HEADS = [pytest.param(4, 4, id="mha"), pytest.param(4, 2, id="gqa"), pytest.param(4, 1, id="mqa")]


@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_prefill_then_decode(heads: int, kv_heads: int) -> None:
    model = tiny_model(heads, kv_heads)
    h = PagedHarness(model)
    tokens = random_tokens(14, seed=1)
    ref = dense_logits(model, tokens)
    seq = h.new_seq(tokens)
    (prefill,) = h.run([(seq, 11)])  # 11 tokens: 2 full blocks of 4 + a partial one
    torch.testing.assert_close(prefill, ref[:11], atol=ATOL, rtol=0)
    for pos in (11, 12, 13):
        (step,) = h.run([(seq, 1)])
        torch.testing.assert_close(step[0], ref[pos], atol=ATOL, rtol=0)
    assert len(seq.block_table) == 4


@pytest.mark.parametrize("chunks", [[5, 3, 4], [4, 4, 4], [1, 7, 1, 3]])
def test_chunked_prefill(chunks: list[int]) -> None:
    model = tiny_model()
    h = PagedHarness(model)
    tokens = random_tokens(sum(chunks), seed=2)
    seq = h.new_seq(tokens)
    got = torch.cat([h.run([(seq, n)])[0] for n in chunks])
    torch.testing.assert_close(got, dense_logits(model, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_batch(backend: str) -> None:
    """Prefill chunks and decodes of four sequences in one forward, listed out of order on purpose."""
    model = tiny_model()
    h = PagedHarness(model, backend=backend)
    toks = {name: random_tokens(n, seed=i) for i, (name, n) in enumerate([("a", 9), ("b", 13), ("c", 6), ("d", 7)])}
    seqs = {name: h.new_seq(t, name) for name, t in toks.items()}
    h.run([(seqs["a"], 8), (seqs["b"], 5)])  # a: prompt computed; b: first chunk
    h.run([(seqs["c"], 5)])
    out = h.run([(seqs["b"], 8), (seqs["a"], 1), (seqs["d"], 7), (seqs["c"], 1)])
    expect = [dense_logits(model, toks["b"])[5:13], dense_logits(model, toks["a"])[8:9],
              dense_logits(model, toks["d"]), dense_logits(model, toks["c"])[5:6]]
    for got, ref in zip(out, expect):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_prefill_over_shared_cached_prefix() -> None:
    """A second sequence reuses the first's full blocks and computes only its own suffix."""
    model = tiny_model()
    h = PagedHarness(model)
    prefix = random_tokens(8, seed=3)
    first = h.new_seq(prefix + random_tokens(3, seed=4), "first")
    h.run([(first, 11)])
    second = h.new_seq(prefix + random_tokens(5, seed=5), "second")
    second.block_table = h.pool.fork(first.block_table[:2])
    second.num_cached_tokens = second.num_computed_tokens = 8
    (suffix,) = h.run([(second, 5)])
    torch.testing.assert_close(suffix, dense_logits(model, second.all_token_ids)[8:], atol=ATOL, rtol=0)
    assert second.block_table[:2] == first.block_table[:2]
    assert [h.pool.ref_count(b) for b in first.block_table[:2]] == [2, 2]


def test_dense_reference_differs_when_kv_is_corrupted() -> None:
    """Guard on the oracle comparison: damaging one cached block changes the decode logits."""
    model = tiny_model()
    h = PagedHarness(model)
    tokens = random_tokens(10, seed=6)
    seq = h.new_seq(tokens)
    h.run([(seq, 9)])
    h.pool.kv[seq.block_table[0]].add_(1.0)
    (step,) = h.run([(seq, 1)])
    assert (step[0] - dense_logits(model, tokens)[9]).abs().max() > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_triton_engine_matches_dense() -> None:
    """The whole paged model on CUDA with the compiled Triton kernels, a realistic head size and block size."""
    model = tiny_model(8, 2, device="cuda", hidden_size=512, head_dim=64, num_layers=3)
    h = PagedHarness(model, backend="triton", block_size=16, num_blocks=64)
    toks = {name: random_tokens(n, seed=i) for i, (name, n) in enumerate([("a", 200), ("b", 77), ("c", 33)])}
    seqs = {name: h.new_seq(t, name) for name, t in toks.items()}
    first = h.run([(seqs["a"], 150), (seqs["b"], 76), (seqs["c"], 33)])
    second = h.run([(seqs["b"], 1), (seqs["a"], 50)])
    expect = {name: dense_logits(model, t) for name, t in toks.items()}
    torch.testing.assert_close(first[0], expect["a"][:150], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(first[2], expect["c"], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(second[0], expect["b"][76:], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(second[1], expect["a"][150:], atol=1e-3, rtol=1e-3)
