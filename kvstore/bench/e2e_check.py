"""What one timed ``e2e`` request returned, and the checks that make its TTFT worth reporting.

A cached mode's TTFT means something only if the request (a) served its
whole shared prefix from the tier the mode names and computed nothing but
its suffix, and (b) produced the same output tokens as the same prompt
computed from scratch. Either failing raises :class:`SuiteError`, so a run
that measured the wrong thing, or a cache that returns wrong KV, fails
loudly instead of reporting a speedup.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvstore.bench.harness import SuiteError

CACHED_MODES: tuple[str, ...] = ("gpu", "host", "disk")
"""Where the shared prefix is when a cached mode's request arrives (a tier name of the connector API)."""
MODES: tuple[str, ...] = ("recompute", *CACHED_MODES)
"""Every timed mode, the reference first."""


@dataclass(frozen=True)
class RunRecord:
    """One finished request: its time to first token, its output and where its prompt's tokens came from."""

    ttft_s: float
    output_ids: tuple[int, ...]
    cached_by_tier: Mapping[str, int]
    """Prompt tokens served from each tier (``gpu``, ``host``, ``disk``)."""
    computed_tokens: int
    """Prompt tokens the engine computed."""
    prompt_tokens: int


def check_run(mode: str, where: str, run: RunRecord, reference: RunRecord | None, prefix_tokens: int) -> None:
    """Raise :class:`SuiteError` unless ``run`` is what ``mode`` claims to measure. Changes nothing.

    ``recompute``: nothing cached, every prompt token computed. A cached mode
    (:data:`CACHED_MODES`): exactly ``prefix_tokens`` tokens served, all from
    the tier ``mode``, the rest computed, and output tokens equal to
    ``reference`` (the same prompt's recompute run) token for token.
    ``where`` names the request in the message (``"repeat 2"``).
    """
    where = f"{where}, mode {mode}"
    cached = {tier: n for tier, n in run.cached_by_tier.items() if n}
    if mode == "recompute":
        if cached or run.computed_tokens != run.prompt_tokens:
            raise SuiteError(f"{where}: expected all {run.prompt_tokens} prompt tokens computed, got "
                             f"{run.computed_tokens} computed and cached {cached}")
        return
    if mode not in CACHED_MODES:
        raise ValueError(f"unknown e2e mode {mode!r}; expected one of {MODES}")
    if cached != {mode: prefix_tokens} or run.computed_tokens != run.prompt_tokens - prefix_tokens:
        raise SuiteError(f"{where}: expected the {prefix_tokens}-token prefix served from {mode} and "
                         f"{run.prompt_tokens - prefix_tokens} tokens computed, got cached {cached} and "
                         f"{run.computed_tokens} computed")
    if reference is None:
        raise ValueError(f"{where}: a cached mode needs the recompute run to compare with")
    if run.output_ids != reference.output_ids:
        at = next((i for i, (a, b) in enumerate(zip(run.output_ids, reference.output_ids)) if a != b),
                  min(len(run.output_ids), len(reference.output_ids)))
        raise SuiteError(f"{where}: output tokens differ from recompute at position {at}: "
                         f"{list(run.output_ids)} != {list(reference.output_ids)} (recompute); the KV served "
                         f"from {mode} is not what computing the prompt gives")
