"""Continuous batching: which sequences run this step, and how many tokens each computes.

Every step has a token budget (``max_num_batched_tokens``). Running sequences
are served first, in admission order: a decode takes one token, an unfinished
prefill takes as much of the rest of its prompt as the budget allows (chunked
prefill). When the pool cannot hold a running sequence's new tokens, the most
recently admitted running sequence is preempted: its blocks are freed and it
goes back to the front of the waiting queue to be recomputed later. Then
waiting sequences are admitted, oldest first, while budget, sequence slots and
free blocks last. No admission happens in a step that preempted, so a freed
sequence is not immediately displaced by a newcomer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import SequenceState, SequenceStatus
from kvstore.errors import IntegrityError


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` positions of ``seq`` starting at ``start`` (its ``num_computed_tokens`` at scheduling)."""

    seq: SequenceState
    start: int
    num_tokens: int

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the sequence's last token, so its logits are sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: the chunks to compute and the sequences preempted to make room."""

    chunks: list[ScheduledChunk]
    preempted: list[SequenceState]

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Waiting and running queues over a :class:`BlockManager`."""

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive, got "
                             f"{max_num_batched_tokens} and {max_num_seqs}")
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []

    def add(self, seq: SequenceState) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Plan one step; allocates blocks for every scheduled chunk and frees those of preempted sequences."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[SequenceState] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= n
                i += 1
                continue
            break  # `seq` preempted itself: everything after it is gone too
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            self.block_manager.admit(seq)
            if seq.num_computed_tokens >= seq.num_tokens:
                raise IntegrityError(f"admission of {seq.request_id!r} left no token to compute "
                                     f"({seq.num_computed_tokens} of {seq.num_tokens} cached)")
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate_slots(seq, n):
                self.block_manager.free(seq)  # undo what admit took (cached prefix blocks)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return SchedulerOutput(chunks, preempted)

    def finish(self, seq: SequenceState) -> None:
        """Remove a stopped sequence from the running queue and free its blocks."""
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def abort(self, seq: SequenceState) -> None:
        """Drop ``seq`` wherever it is and free its blocks (a waiting sequence holds none); it becomes FINISHED."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
        elif seq in self.running:
            self.finish(seq)

    def _preempt(self, seq: SequenceState) -> None:
        # The manager decides what happens to the KV (dropped for recompute, or swapped out to
        # a lower tier); the tokens stay and are prefilled again, minus what is cached, on readmission.
        self.block_manager.preempt(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
