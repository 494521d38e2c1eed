"""Per-request generation settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` is greedy decoding (argmax; deterministic).
    ``top_k = 0`` and ``top_p = 1.0`` disable those filters. ``seed`` gives the
    request its own random generator, so its samples do not depend on what
    else is in the batch. Generation stops after ``max_tokens`` new tokens, on
    an end-of-sequence token (unless ``ignore_eos``), or when the text contains
    one of ``stop`` (the stop string is cut from the output text).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain an empty string")

    @property
    def greedy(self) -> bool:
        """Whether sampling is plain argmax."""
        return self.temperature == 0.0
