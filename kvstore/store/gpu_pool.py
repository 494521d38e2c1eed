"""The GPU block pool (L1): preallocated paged KV memory with reference counts.

One tensor, block-major, so one block is one contiguous byte range::

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
       block id    layer      K/V  token slot

Kernels read one layer of K (or V) as a strided view
``kv[:, layer, 0] -> [num_blocks, block_size, num_kv_heads, head_dim]``.
A token's *slot* is ``block_id * block_size + offset``: the row of that view
flattened to ``[num_blocks * block_size, num_kv_heads, head_dim]``.

Block ids are plain ints; a free deque and a reference-count list are all the
bookkeeping (nano-vllm's block manager). ``fork`` shares blocks, and
``copy_on_write`` gives a sequence a private copy of a shared block before it
writes into it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from operator import itemgetter

import torch

from kvstore.errors import BlockStateError, IntegrityError, OutOfBlocks
from kvstore.layout import KVLayout


def default_device() -> torch.device:
    """CUDA when available, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class GPUBlockPool:
    """Fixed-size pool of KV blocks on one device.

    ``allocate`` hands out blocks with reference count 1; ``incref``/``fork``
    add references; ``free`` drops one reference per id and returns a block to
    the free list at zero. Allocation never blocks: it raises
    :class:`OutOfBlocks` (or ``try_allocate`` returns ``None``).
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device) if device is not None else default_device()
        self.kv = torch.zeros((num_blocks, *layout.block_shape), dtype=layout.torch_dtype, device=self.device)
        self._free: deque[int] = deque(range(num_blocks))
        self._ref: list[int] = [0] * num_blocks

    # ------------------------------------------------------------------ state
    @property
    def num_free(self) -> int:
        """Blocks with reference count zero."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with at least one reference."""
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        """Current reference count of ``block_id``."""
        self._check_id(block_id)
        return self._ref[block_id]

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` blocks are free now. Changes nothing."""
        return n <= len(self._free)

    # ------------------------------------------------------------- allocation
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each).

        Raises :class:`OutOfBlocks` and allocates nothing when fewer are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            if self._ref[b] != 0:
                raise IntegrityError(f"free block {b} has reference count {self._ref[b]}")
            self._ref[b] = 1
        return ids

    def try_allocate(self, n: int) -> list[int] | None:
        """Like :meth:`allocate` but returns ``None`` instead of raising when short."""
        if n > len(self._free):
            return None
        return self.allocate(n)

    def incref(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (each must be in use)."""
        ids = list(block_ids)
        if not ids:
            return
        ref = self._ref
        try:  # checks in C first: one gather of the counts (IndexError past the end; negatives caught by min)
            bad = min(ids) < 0 or min(itemgetter(*ids)(ref) if len(ids) > 1 else (ref[ids[0]],)) <= 0
        except (IndexError, TypeError):
            bad = True
        if bad:
            for b in ids:
                self._check_id(b)
                if ref[b] <= 0:
                    raise BlockStateError(f"incref of free block {b}")
        for b in ids:
            ref[b] += 1

    def free(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one reference per id; returns the ids that became free.

        A free block is zeroed lazily (never): its bytes are garbage until the
        next owner writes them, as in every paged cache.
        """
        for b in block_ids:
            self._check_id(b)
        counts: dict[int, int] = {}
        for b in block_ids:
            counts[b] = counts.get(b, 0) + 1
        for b, c in counts.items():
            if self._ref[b] < c:
                raise BlockStateError(f"free of block {b} with reference count {self._ref[b]} ({c} frees requested)")
        released: list[int] = []
        for b in block_ids:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)
                released.append(b)
        return released

    def fork(self, block_table: Sequence[int]) -> list[int]:
        """Share every block of ``block_table`` with a new sequence; returns its table."""
        self.incref(block_table)
        return list(block_table)

    def copy_on_write(self, block_table: list[int], index: int) -> int:
        """Make ``block_table[index]`` private before a write; returns the block id to write.

        If the block is shared (reference count > 1) a new block is allocated,
        the contents copied, the old reference dropped and the table updated in
        place. Raises :class:`OutOfBlocks` (table unchanged) when no block is free.
        """
        old = block_table[index]
        self._check_id(old)
        if self._ref[old] <= 0:
            raise BlockStateError(f"copy_on_write of free block {old}")
        if self._ref[old] == 1:
            return old
        (new,) = self.allocate(1)
        self.kv[new].copy_(self.kv[old])
        self._ref[old] -= 1
        block_table[index] = new
        return new

    # ------------------------------------------------------------------ views
    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided views ``(K, V)`` of one layer, each ``[num_blocks, block_size, kv_heads, head_dim]``."""
        return self.kv[:, layer, 0], self.kv[:, layer, 1]

    def block(self, block_id: int) -> torch.Tensor:
        """View of one block, shape :attr:`KVLayout.block_shape`."""
        self._check_id(block_id)
        return self.kv[block_id]

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """One block as a flat ``uint8`` view (for copies to and from other tiers)."""
        return self.block(block_id).view(-1).view(torch.uint8)

    # -------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` unless free + used == total and counts agree."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise IntegrityError("free list holds a block twice")
        for b in range(self.num_blocks):
            in_free = b in free_set
            if in_free and self._ref[b] != 0:
                raise IntegrityError(f"block {b} is free with reference count {self._ref[b]}")
            if not in_free and self._ref[b] <= 0:
                raise IntegrityError(f"block {b} is neither free nor referenced")
        used = sum(1 for r in self._ref if r > 0)
        if used + len(free_set) != self.num_blocks:
            raise IntegrityError(f"free {len(free_set)} + used {used} != total {self.num_blocks}")

    def _check_id(self, block_id: int) -> None:
        if not (0 <= block_id < self.num_blocks):
            raise BlockStateError(f"block id {block_id} out of range [0, {self.num_blocks})")
