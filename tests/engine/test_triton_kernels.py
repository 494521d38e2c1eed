"""Triton kernels against the torch reference: interpreter on tiny shapes, real shapes on CUDA.

Every case uses a strided per-layer view of a block-major pool tensor, block
tables that are permutations (never contiguous), partial last blocks and, where
``group > 1``, grouped-query attention.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels import reference
from engine.kernels.backend import triton_interpreter_enabled

cuda = torch.cuda.is_available()
if not (cuda or triton_interpreter_enabled()):
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from engine.kernels import triton_kernels  # noqa: E402


def _setup(seq_lens: list[int], query_lens: list[int], block_size: int, kv_heads: int, group: int, head_dim: int,
           dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 3
    # Layer 1 of a 2-layer block-major pool: the views are strided, as in the engine.
    pool = torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = torch.tensor([ids[i * max_blocks:(i + 1) * max_blocks] for i in range(len(seq_lens))],
                          dtype=torch.int32, device=device)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=gen).to(device, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return pool, k_cache, v_cache, tables, qsl, q, lens


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


SMALL = [  # block_size, kv_heads, group, head_dim, dtype
    pytest.param(4, 2, 2, 8, torch.float32, id="bs4-gqa2-fp32"),
    pytest.param(4, 1, 4, 16, torch.float16, id="bs4-mqa4-fp16"),
    pytest.param(6, 2, 1, 12, torch.float32, id="bs6-mha-d12-fp32"),
    pytest.param(16, 2, 3, 8, torch.float32, id="bs16-gqa3-fp32"),
]


@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim", "dtype"), SMALL)
def test_prefill_matches_reference(block_size, kv_heads, group, head_dim, dtype) -> None:
    seq_lens, query_lens = [7, 21, 18], [7, 5, 18]  # whole prompt, chunk after a cached prefix, > BLOCK_M
    _, kc, vc, tables, qsl, q, lens = _setup(seq_lens, query_lens, block_size, kv_heads, group, head_dim, dtype, "cpu")
    got = triton_kernels.paged_prefill(q, kc, vc, tables, qsl, lens, 0.25)
    torch.testing.assert_close(got, reference.paged_prefill(q, kc, vc, tables, qsl, lens, 0.25), **_tol(dtype))


@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim", "dtype"), SMALL)
def test_decode_matches_reference(block_size, kv_heads, group, head_dim, dtype) -> None:
    seq_lens = [1, 9, 23, 16]
    _, kc, vc, tables, _, q, lens = _setup(seq_lens, [1] * 4, block_size, kv_heads, group, head_dim, dtype, "cpu")
    got = triton_kernels.paged_decode(q, kc, vc, tables, lens, 0.3)
    torch.testing.assert_close(got, reference.paged_decode(q, kc, vc, tables, lens, 0.3), **_tol(dtype))


def _poison_before_window(pool: torch.Tensor, tables: torch.Tensor, first_keys: list[int], block_size: int) -> None:
    """NaN in every block wholly before each sequence's first visible key: a kernel that reads one fails."""
    for b, first in enumerate(first_keys):
        for j in range(first // block_size):
            pool[int(tables[b, j])] = float("nan")


@pytest.mark.parametrize("window", [1, 5, 8])
def test_sliding_window_prefill_and_decode_match_reference_and_never_read_before_the_window(window: int) -> None:
    """Keys ``q - window < k <= q`` only; blocks before the window (here NaN) are never read. Prefill chunks
    longer than the window (rows of one tile with nothing visible in the first blocks read) included."""
    bs, seq_lens, query_lens = 4, [7, 21, 30], [7, 5, 18]
    pool, kc, vc, tables, qsl, q, lens = _setup(seq_lens, query_lens, bs, 2, 2, 8, torch.float32, "cpu", seed=3)
    _poison_before_window(pool, tables, [max(0, n - ql - window + 1) for n, ql in zip(seq_lens, query_lens)], bs)
    want = reference.paged_prefill(q, kc, vc, tables, qsl, lens, 0.25, window=window)
    assert not want.isnan().any()
    torch.testing.assert_close(triton_kernels.paged_prefill(q, kc, vc, tables, qsl, lens, 0.25, window=window), want,
                               **_tol(torch.float32))
    qd = q[: len(seq_lens)].contiguous()
    want_d = reference.paged_decode(qd, kc, vc, tables, lens, 0.25, window=window)
    assert not want_d.isnan().any()
    torch.testing.assert_close(triton_kernels.paged_decode(qd, kc, vc, tables, lens, 0.25, window=window), want_d,
                               **_tol(torch.float32))


def test_a_window_wider_than_the_sequence_is_full_attention() -> None:
    _, kc, vc, tables, qsl, q, lens = _setup([7, 21], [7, 5], 4, 2, 2, 8, torch.float32, "cpu", seed=4)
    torch.testing.assert_close(reference.paged_prefill(q, kc, vc, tables, qsl, lens, 0.25, window=64),
                               reference.paged_prefill(q, kc, vc, tables, qsl, lens, 0.25))
    torch.testing.assert_close(triton_kernels.paged_prefill(q, kc, vc, tables, qsl, lens, 0.25, window=64),
                               reference.paged_prefill(q, kc, vc, tables, qsl, lens, 0.25), **_tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference(dtype) -> None:
    pool, kc, vc, tables, _, _, _ = _setup([10, 7], [1, 1], 4, 2, 1, 12, dtype, "cpu")
    expect = pool.clone()
    slots = torch.tensor([int(tables[0, 2]) * 4 + 1, int(tables[1, 0]) * 4 + 3, int(tables[1, 1]) * 4])
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(3, 2, 12, generator=gen), torch.randn(3, 2, 12, generator=gen)
    triton_kernels.write_kv(k, v, kc, vc, slots)
    reference.write_kv(k, v, expect[:, 1, 0], expect[:, 1, 1], slots)
    assert torch.equal(pool, expect)
    assert torch.equal(pool[int(tables[1, 0]), 1, 0, 3], k[1].to(dtype))  # the exact slot, and nothing else moved


@pytest.mark.skipif(not cuda, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim"), [(16, 8, 4, 128), (32, 4, 8, 64), (16, 2, 7, 80)])
def test_cuda_kernels_real_shapes(dtype, block_size, kv_heads, group, head_dim) -> None:
    seq_lens, query_lens = [1, 517, 2048, 130, 33], [1, 517, 300, 1, 17]
    pool, kc, vc, tables, qsl, q, lens = _setup(seq_lens, query_lens, block_size, kv_heads, group, head_dim, dtype,
                                                "cuda")
    scale = head_dim ** -0.5
    tol = _tol(dtype) if dtype != torch.float32 else {"atol": 1e-4, "rtol": 1e-4}
    qd = q[: len(seq_lens)].contiguous()
    for window in (0, 96):  # full attention, and a sliding window shorter than the long sequences
        torch.testing.assert_close(triton_kernels.paged_prefill(q, kc, vc, tables, qsl, lens, scale, window=window),
                                   reference.paged_prefill(q, kc, vc, tables, qsl, lens, scale, window=window), **tol)
        torch.testing.assert_close(triton_kernels.paged_decode(qd, kc, vc, tables, lens, scale, window=window),
                                   reference.paged_decode(qd, kc, vc, tables, lens, scale, window=window), **tol)
    slots = torch.randperm(kc.shape[0] * block_size, device="cuda")[:1000]
    k = torch.randn(1000, kv_heads, head_dim, device="cuda", dtype=dtype)
    expect = pool.clone()
    triton_kernels.write_kv(k, k * 2, kc, vc, slots)
    reference.write_kv(k, k * 2, expect[:, 1, 0], expect[:, 1, 1], slots)
    assert torch.equal(pool, expect)
