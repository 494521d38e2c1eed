"""Plain torch references of the paged-attention kernels (the CPU path and the test oracle).

Cache tensors are one layer's strided views of the block pool::

    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]

and a token's slot is ``block_id * block_size + offset``. A sequence's KV is
gathered through its block table::

    block_table = [7, 2, 9]            block_size = 4, seq_len = 10
    positions     0 1 2 3 | 4 5 6 7 | 8 9 . .
    blocks        ---7--- | ---2--- | ---9--- (last block partial)

Prefill queries are the *last* ``query_len`` tokens of the sequence, so query
row ``i`` sits at position ``context_len + i`` with
``context_len = seq_len - query_len`` (cached prefix plus earlier chunks), and
may attend to keys at positions ``<= context_len + i``. With a sliding
``window`` (``> 0``, Mistral's and Gemma's local layers) it attends only to the
last ``window`` of them: key ``j`` is seen by query ``i`` iff ``i - window < j <= i``
(transformers' rule), and keys before the first query's window are never read,
so blocks there may hold anything.
"""

from __future__ import annotations

import torch


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [T, KVH, D]`` at ``slot_mapping [T]`` in the caches (in place)."""
    block_size = k_cache.shape[1]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first: int = 0) -> torch.Tensor:
    """Tokens ``[first', seq_len)`` of one sequence, ``[seq_len - first', KVH, D]``, where ``first'`` is
    ``first`` rounded down to its block (blocks before it are not read)."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    skip = first // block_size
    blocks = cache[block_table[skip:num_blocks].long()]
    return blocks.reshape((num_blocks - skip) * block_size, *cache.shape[2:])[: seq_len - skip * block_size]


def _first_key(context_len: int, window: int) -> int:
    """The first key position any query from ``context_len`` on may see (0 without a window)."""
    return max(0, context_len - window + 1) if window > 0 else 0


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int,
            scale: float, window: int = 0, key_start: int = 0) -> torch.Tensor:
    """Causal attention of ``q [Q, H, D]`` (positions ``context_len..``) over ``keys [S, KVH, D]`` (positions
    ``key_start..``), each query seeing only the last ``window`` keys when ``window > 0``."""
    group = q.shape[1] // keys.shape[1]
    qf = q.float().transpose(0, 1)                                   # [H, Q, D]
    kf = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    vf = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale                       # [H, Q, S]
    q_pos = context_len + torch.arange(q.shape[0], device=q.device)
    k_pos = key_start + torch.arange(keys.shape[0], device=q.device)
    hidden = k_pos[None, :] > q_pos[:, None]
    if window > 0:
        hidden |= k_pos[None, :] <= q_pos[:, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """One query token per sequence: ``q [B, H, D]`` attends over ``seq_lens[b]`` cached tokens -> ``[B, H, D]``
    (the last ``window`` of them when ``window > 0``).

    The query's own K/V must already be written (it is the last cached token).
    """
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        first = _first_key(n - 1, window)
        keys = _gather(k_cache, block_tables[b], n, first)
        values = _gather(v_cache, block_tables[b], n, first)
        out[b:b + 1] = _attend(q[b:b + 1], keys, values, n - 1, scale, window, first // bs * bs)
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  max_query_len: int | None = None, window: int = 0) -> torch.Tensor:
    """A chunk of new tokens per sequence over its cached prefix plus itself, causal (each query over the
    last ``window`` keys when ``window > 0``).

    ``q [T, H, D]`` holds sequence ``b``'s queries in rows
    ``query_start_loc[b]:query_start_loc[b+1]``; their K/V must already be
    written. Returns ``[T, H, D]``. ``max_query_len`` is accepted for
    signature parity with the Triton kernel and not needed here.
    """
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        n = int(seq_lens[b])
        context = n - (end - start)
        first = _first_key(context, window)
        keys = _gather(k_cache, block_tables[b], n, first)
        values = _gather(v_cache, block_tables[b], n, first)
        out[start:end] = _attend(q[start:end], keys, values, context, scale, window, first // bs * bs)
    return out
