"""The scheduler's only door to KV memory: a small class a connector-backed manager replaces.

:class:`BlockManager` allocates and frees through the kvstore
:class:`~kvstore.store.gpu_pool.GPUBlockPool` and caches nothing across requests.
A connector-backed subclass overrides the hooks to add prefix caching:

- :meth:`admit` looks up the prompt's cached prefix and hands the sequence a
  block table whose first full blocks already hold KV (setting
  ``num_cached_tokens`` and ``num_computed_tokens``);
- :meth:`before_layer` returns a callable the model calls before each layer,
  so an asynchronous load can be awaited layer by layer;
- :meth:`on_computed` sees the sequence after each step and can commit the
  blocks that became full;
- :meth:`free` can save blocks to a lower tier instead of dropping them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.sequence import SequenceState
from kvstore.errors import IntegrityError
from kvstore.store.gpu_pool import GPUBlockPool


class BlockManager:
    """Block tables of running sequences, backed by a :class:`GPUBlockPool`."""

    def __init__(self, pool: GPUBlockPool) -> None:
        self.pool = pool
        self.block_size = pool.layout.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks the pool can hand out now. Changes nothing."""
        return self.pool.num_free

    def admit(self, seq: SequenceState) -> None:
        """Prepare a waiting sequence that is about to be scheduled.

        Here: no prefix cache, so the sequence starts from nothing. A
        replacement may fill ``seq.block_table`` with cached blocks and set
        ``num_cached_tokens == num_computed_tokens`` to a multiple of the block
        size that is below ``seq.num_tokens`` (at least one token must be left
        to compute, or there would be no logits to sample from).
        """
        if seq.block_table:
            raise IntegrityError(f"sequence {seq.request_id!r} admitted while holding blocks {seq.block_table}")
        seq.num_cached_tokens = 0
        seq.num_computed_tokens = 0

    def allocate_slots(self, seq: SequenceState, num_new_tokens: int) -> bool:
        """Grow ``seq.block_table`` to hold ``num_computed_tokens + num_new_tokens`` tokens.

        Returns ``False`` and changes nothing when the pool is short. Blocks
        already in the table are never written by earlier positions again, so a
        shared (cached) prefix block is safe: new tokens land after it.
        """
        needed = seq.blocks_needed(seq.num_computed_tokens + num_new_tokens, self.block_size)
        if needed == 0:
            return True
        ids = self.pool.try_allocate(needed)
        if ids is None:
            return False
        seq.block_table.extend(ids)
        return True

    def before_layer(self, seqs: Sequence[SequenceState]) -> Callable[[int], None] | None:
        """A callable run before each layer of the step that computes ``seqs``, or ``None`` (nothing to wait for)."""
        return None

    def on_computed(self, seq: SequenceState) -> None:
        """Called after a step advanced ``seq.num_computed_tokens``; a prefix cache commits full blocks here."""

    def preempt(self, seq: SequenceState) -> None:
        """Take a running sequence's KV away to make room; by default it is dropped and recomputed later."""
        self.free(seq)

    def free(self, seq: SequenceState) -> None:
        """Drop the sequence's blocks (finished or preempted) and reset its progress to nothing computed."""
        if seq.block_table:
            self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
