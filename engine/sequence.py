"""One request's state as it moves through the scheduler.

Token accounting (``bs`` = block size)::

    all tokens:  [ prompt .................. | output ..... ]
                 [ cached ][ computed by us ][ not yet computed ]
                 0   num_cached   num_computed_tokens     num_tokens

- ``num_cached_tokens``: prompt tokens whose KV was already in the sequence's
  first blocks when it was admitted (a prefix hit handed over by the KV cache
  manager; 0 without one). Always a multiple of ``bs``.
- ``num_computed_tokens``: tokens whose KV is in the blocks now. The next step
  computes positions ``num_computed_tokens ..`` and attends over every block
  before them, so prefill over a cached prefix and the next chunk of a chunked
  prefill are the same path.
- The newest sampled token has no KV yet: it is the input of the next decode.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued (new or preempted), in the running batch, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceMetrics:
    """Timings and counts reported with the output."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prefill_tokens_computed: int = 0
    num_preemptions: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "host": 0, "disk": 0})
    """Prompt tokens served from each tier at the last admission (a connector-backed manager fills it)."""
    load_wait_time: float = 0.0
    """Seconds the engine waited for prefix loads (stop policy and per-layer waits)."""


@dataclass(eq=False)
class SequenceState:
    """A request: its tokens, its block table and its progress."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    """Tenant salt of the prefix cache: requests share cached blocks only under the same salt."""
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    output_text: str = ""
    metrics: SequenceMetrics = field(default_factory=lambda: SequenceMetrics(arrival_time=time.perf_counter()))

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV the engine still has to compute."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """Whether the sequence has stopped."""
        return self.status is SequenceStatus.FINISHED

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Blocks the table must hold for the KV of the first ``num_tokens`` tokens, beyond what it has."""
        return max(0, -(-num_tokens // block_size) - len(self.block_table))
