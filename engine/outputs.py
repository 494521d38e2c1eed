"""What ``LLM.generate`` returns."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import SequenceState


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request measurements.

    ``time_to_first_token`` is seconds from arrival to the first sampled token.
    ``num_prefill_tokens_computed`` counts tokens computed by prefill chunks,
    including recomputation after a preemption; ``num_cached_tokens`` is the
    prompt prefix that was already cached at (the last) admission.
    """

    time_to_first_token: float | None
    total_time: float | None
    num_prompt_tokens: int
    num_generated_tokens: int
    num_prefill_tokens_computed: int
    num_cached_tokens: int
    num_preemptions: int
    cached_tokens_by_tier: dict[str, int]
    """Cached prompt tokens by the tier they came from (``gpu``, ``host``, ``disk``)."""
    load_wait_time: float
    """Seconds spent waiting for cached blocks to arrive."""

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens the engine computed at the last admission (prompt minus cached)."""
        return self.num_prompt_tokens - self.num_cached_tokens


@dataclass(frozen=True)
class RequestOutput:
    """The result of one request: generated text and token ids, why it stopped, and its metrics."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics

    @classmethod
    def from_sequence(cls, seq: SequenceState) -> RequestOutput:
        """Snapshot of ``seq`` (token lists are copied)."""
        m = seq.metrics
        ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
        total = None if m.finished_time is None else m.finished_time - m.arrival_time
        return cls(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.prompt_token_ids),
            token_ids=list(seq.output_token_ids),
            text=seq.output_text,
            finish_reason=seq.finish_reason,
            metrics=RequestMetrics(
                time_to_first_token=ttft,
                total_time=total,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_generated_tokens=len(seq.output_token_ids),
                num_prefill_tokens_computed=m.num_prefill_tokens_computed,
                num_cached_tokens=seq.num_cached_tokens,
                num_preemptions=m.num_preemptions,
                cached_tokens_by_tier=dict(m.cached_tokens_by_tier),
                load_wait_time=m.load_wait_time,
            ),
        )
