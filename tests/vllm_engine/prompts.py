"""The prompts of the real-engine tests, as token ids of SmolLM2's tokenizer (shared by every engine run)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rig import BLOCK_SIZE, prompt_tokens


@dataclass(frozen=True)
class Prompts:
    long: list[int]
    """33 full blocks and a tail: 1,066 tokens."""
    short: list[int]
    """The first 31 blocks of ``long`` and a tail: loading it leaves 31 of ``long``'s blocks in vLLM's cache."""
    turns: list[list[int]]
    """A multi-turn chat: each turn is the previous one extended (by a reply and a new question)."""
    shared: list[list[int]]
    """8 prompts on one 1,000-token prefix, each with its own 48-token question."""
    other: list[int]
    """An unrelated 700-token prompt (tenants, damaged blocks)."""

    @classmethod
    def of(cls, model: Path) -> Prompts:
        long = prompt_tokens(model, 33 * BLOCK_SIZE + 10, seed=1)
        turns, t = [], prompt_tokens(model, 300, seed=2)
        for k in range(3):
            turns.append(t)
            t = t + prompt_tokens(model, 150 + 40 * k, seed=10 + k)
        prefix = prompt_tokens(model, 1000, seed=3)
        shared = [prefix + prompt_tokens(model, 48, seed=20 + i) for i in range(8)]
        return cls(long, long[: 31 * BLOCK_SIZE + 5], turns, shared, prompt_tokens(model, 700, seed=4))
