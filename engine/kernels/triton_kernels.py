"""Triton kernels: write new K/V into their slots, paged decode, paged prefill over a cached prefix.

They take the same arguments as :mod:`engine.kernels.reference` and must give
the same results. Cache views are strided (one layer of the block-major pool),
so every kernel receives the block / slot / head strides and assumes only that
``head_dim`` is contiguous. Sizes that need not be powers of two (block size,
head dim, GQA group) are padded to one and masked.

Attention uses the online softmax of FlashAttention: running max ``m``, running
sum ``l`` and an unnormalised accumulator, rescaled by ``exp(m_old - m_new)``
each time a new block raises the max. Without a window, block 0 holds position 0,
which every query may see; with one, a row may see nothing in the first blocks
read, so its max stays ``-inf`` and the exponentials are taken against 0 (all
zero) until its window starts. Every row sees its own key, so none divides by zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int, minimum: int) -> int:
    return max(minimum, triton.next_power_of_2(n))


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     block_size, head_dim, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    key = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dmask)
    val = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dmask)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + h * stride_ch + d
    tl.store(kc_ptr + dst, key.to(kc_ptr.dtype.element_ty), mask=dmask)
    tl.store(vc_ptr + dst, val.to(vc_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seqlen_ptr, out_ptr, scale,
                   stride_qb, stride_qh, stride_ob, stride_oh,
                   stride_cb, stride_cs, stride_ch, stride_btb,
                   block_size, head_dim, group, window,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per (sequence, KV head): all `group` query heads sharing the
    # KV head read each cache block once.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seqlen_ptr + b)
    g = tl.arange(0, BLOCK_G)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    gmask = g < group
    dmask = d < head_dim
    heads = kvh * group + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # A sliding window (window > 0) sees keys after seq_len - 1 - window only: earlier blocks are not read.
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    for j in range(first // block_size, tl.cdiv(seq_len, block_size)):
        blk = tl.load(bt_ptr + b * stride_btb + j).to(tl.int64)
        pos = j * block_size + n
        nmask = (n < block_size) & (pos < seq_len) & (pos >= first)
        offs = blk * stride_cb + n[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + offs, mask=kvmask, other=0.0).to(tl.float32)
        v = tl.load(vc_ptr + offs, mask=kvmask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row whose keys so far are all masked
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padding rows past a window see nothing
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, qsl_ptr, seqlen_ptr, out_ptr, scale,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_cb, stride_cs, stride_ch, stride_btb,
                    block_size, head_dim, group, window,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    IEEE: tl.constexpr):
    # One program per (tile of BLOCK_M query rows, sequence, query head).
    #   seq positions: [0 ........ context_len) [context_len ... seq_len)
    #                   cached prefix/old chunks   this chunk's queries
    # Query row m sits at position context_len + m and sees keys <= that.
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // group
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seqlen_ptr + b)
    context_len = seq_len - q_len
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    mmask = m < q_len
    dmask = d < head_dim
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    q = q.to(kc_ptr.dtype.element_ty)
    q_pos = context_len + m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys past this tile's last query position are masked for every row: skip them.
    last_key = tl.minimum(context_len + (tile + 1) * BLOCK_M, seq_len)
    # With a sliding window, keys before this tile's first query's window are masked for every row: skip them.
    first_key = tl.where(window > 0, tl.maximum(context_len + tile * BLOCK_M - window + 1, 0), 0)
    for j in range(first_key // block_size, tl.cdiv(last_key, block_size)):
        blk = tl.load(bt_ptr + b * stride_btb + j).to(tl.int64)
        pos = j * block_size + n
        nmask = (n < block_size) & (pos < seq_len)
        offs = blk * stride_cb + n[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + offs, mask=kvmask, other=0.0)
        v = tl.load(vc_ptr + offs, mask=kvmask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        seen = nmask[None, :] & (pos[None, :] <= q_pos[:, None])
        seen = seen & ((pos[None, :] > q_pos[:, None] - window) | (window <= 0))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row whose keys so far are all masked
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padding rows past a window see nothing
    tl.store(out_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"K/V cache views must share strides with a contiguous head_dim; "
                         f"got {k_cache.stride()} and {v_cache.stride()}")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [T, KVH, D]`` at ``slot_mapping [T]`` (in place). See the reference."""
    _check_cache(k_cache, v_cache)
    k, v = k.contiguous(), v.contiguous()
    t, kv_heads, head_dim = k.shape
    if t == 0:
        return
    _write_kv_kernel[(t, kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], head_dim, BLOCK_D=_pow2(head_dim, 16),
    )


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """One query token per sequence over its cached tokens (the last ``window`` if ``> 0``) -> ``[B, H, D]``.
    See the reference."""
    _check_cache(k_cache, v_cache)
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    if batch == 0:
        return out
    _decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k_cache.shape[1], head_dim, group, window,
        BLOCK_G=_pow2(group, 2), BLOCK_N=_pow2(k_cache.shape[1], 16), BLOCK_D=_pow2(head_dim, 16),
    )
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  max_query_len: int | None = None, window: int = 0) -> torch.Tensor:
    """A chunk of new tokens per sequence over its cached prefix plus itself, causal (each query over the
    last ``window`` keys if ``> 0``). See the reference.

    ``max_query_len`` (the longest chunk) sizes the grid; it is computed from
    ``query_start_loc`` when not given, at the cost of a device sync.
    """
    _check_cache(k_cache, v_cache)
    q = q.contiguous()
    out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if batch == 0 or q.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    heads, head_dim = q.shape[1], q.shape[2]
    block_m = 16
    grid = (triton.cdiv(max_query_len, block_m), batch, heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k_cache.shape[1], head_dim, heads // k_cache.shape[2], window,
        BLOCK_M=block_m, BLOCK_N=_pow2(k_cache.shape[1], 16), BLOCK_D=_pow2(head_dim, 16),
        IEEE=k_cache.dtype == torch.float32,
    )
    return out
