"""Turning a row of logits into the next token, and deciding when a sequence stops."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import SequenceState


class Sampler:
    """Greedy, temperature, top-k and top-p sampling with per-request generators.

    A request with a ``seed`` gets its own ``torch.Generator`` seeded once, so
    its samples depend only on its own logits and seed, not on batch order. A
    request without one draws from a generator seeded by ``default_seed`` and
    the request id, so runs are still reproducible.
    """

    def __init__(self, default_seed: int = 0) -> None:
        self.default_seed = default_seed
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, seq: SequenceState, logits: torch.Tensor) -> int:
        """The next token for ``seq`` from its fp32 ``logits [vocab]``."""
        params = seq.params
        if params.greedy:
            return int(torch.argmax(logits))
        probs = filtered_probs(logits.float().cpu(), params)
        return int(torch.multinomial(probs, 1, generator=self._generator(seq)))

    def release(self, seq: SequenceState) -> None:
        """Forget the generator of a finished sequence."""
        self._generators.pop(seq.request_id, None)

    def _generator(self, seq: SequenceState) -> torch.Generator:
        gen = self._generators.get(seq.request_id)
        if gen is None:
            seed = seq.params.seed
            if seed is None:
                seed = (self.default_seed * 1_000_003 + sum(seq.request_id.encode())) & 0x7FFFFFFF
            gen = torch.Generator().manual_seed(seed)
            self._generators[seq.request_id] = gen
        return gen


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p; removed tokens get probability 0.

    Top-p keeps the smallest set of most likely tokens whose mass reaches
    ``top_p`` (the most likely token always stays).
    """
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def check_stop(seq: SequenceState, eos_token_ids: tuple[int, ...], text: str) -> tuple[str | None, str]:
    """``(finish_reason, text)`` after the newest token: ``"stop"`` (EOS or a stop string) or ``"length"``.

    ``text`` is the decoded output so far; on a stop string it is cut just
    before the string's first occurrence. ``None`` means keep going.
    """
    params = seq.params
    for stop in params.stop:
        at = text.find(stop)
        if at != -1:
            return "stop", text[:at]
    if not params.ignore_eos and seq.output_token_ids and seq.output_token_ids[-1] in eos_token_ids:
        return "stop", text
    if len(seq.output_token_ids) >= params.max_tokens:
        return "length", text
    return None, text
