"""Sampling filters, per-request seeds, and the three ways a request stops."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.sampler import Sampler, check_stop, filtered_probs
from engine.sequence import SequenceState

LOGITS = torch.tensor([2.0, 1.0, 0.5, 3.0, -1.0])


def _seq(params: SamplingParams, rid: str = "r") -> SequenceState:
    return SequenceState(rid, [1, 2], params)


def test_greedy_is_argmax() -> None:
    assert Sampler().sample(_seq(SamplingParams()), LOGITS) == 3


def test_top_k_keeps_only_the_k_best() -> None:
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert probs.nonzero().flatten().tolist() == [0, 3]
    torch.testing.assert_close(probs[[0, 3]], torch.tensor([2.0, 3.0]).softmax(0))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    full = LOGITS.softmax(0)  # sorted masses: 3 -> .61, 0 -> .22, 1 -> .08, ...
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    assert probs.nonzero().flatten().tolist() == [0, 3]
    torch.testing.assert_close(probs[[0, 3]], full[[0, 3]] / full[[0, 3]].sum())
    tiny = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))
    assert tiny.nonzero().flatten().tolist() == [3]


def test_temperature_sharpens_and_flattens() -> None:
    cold = filtered_probs(LOGITS, SamplingParams(temperature=0.1))
    hot = filtered_probs(LOGITS, SamplingParams(temperature=10.0))
    assert cold[3] > 0.99 and hot.max() < 0.3


def test_seeded_requests_reproduce_regardless_of_other_requests() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    flat = torch.zeros(50)
    first = [Sampler().sample(_seq(params, "x"), flat) for _ in range(1)]
    sampler = Sampler()
    draws = [sampler.sample(_seq(params, "x"), flat) for _ in range(20)]
    again = Sampler()
    other = _seq(SamplingParams(temperature=1.0, seed=99), "y")
    interleaved = []
    for _ in range(20):
        again.sample(other, flat)
        interleaved.append(again.sample(_seq(params, "x"), flat))
    assert draws == interleaved and draws[0] == first[0]
    assert len(set(draws)) > 5


def test_stop_reasons() -> None:
    seq = _seq(SamplingParams(max_tokens=3, stop=("ab",)))
    seq.output_token_ids = [5]
    assert check_stop(seq, (9,), "xxa") == (None, "xxa")
    assert check_stop(seq, (9,), "xxabyy") == ("stop", "xx")
    seq.output_token_ids = [5, 9]
    assert check_stop(seq, (9,), "q") == ("stop", "q")
    seq.output_token_ids = [5, 6, 7]
    assert check_stop(seq, (9,), "q") == ("length", "q")
    ignore = _seq(SamplingParams(max_tokens=5, ignore_eos=True))
    ignore.output_token_ids = [9]
    assert check_stop(ignore, (9,), "") == (None, "")


def test_generate_stops_on_eos_and_stop_string() -> None:
    llm = LLM(config=EngineConfig(block_size=4, num_gpu_blocks=32, dtype="float32"))
    (free,) = llm.generate("hi", SamplingParams(max_tokens=8, ignore_eos=True))
    first, second = free.token_ids[0], free.token_ids[1]
    llm.eos_token_ids = (second,)
    (eos,) = llm.generate("hi", SamplingParams(max_tokens=8))
    assert eos.token_ids == free.token_ids[:2] and eos.finish_reason == "stop"
    llm.eos_token_ids = ()
    # Stop on the first ASCII character generated after the first token.
    stop_char = next(chr(t) for t in free.token_ids[1:] if 32 <= t < 127)
    end = next(i for i in range(1, 9) if stop_char in llm.tokenizer.decode(free.token_ids[:i]))
    (cut,) = llm.generate("hi", SamplingParams(max_tokens=8, stop=(stop_char,)))
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[:end]
    assert cut.text == llm.tokenizer.decode(free.token_ids[:end]).split(stop_char)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2),
                                 dict(stop=("",))])
def test_bad_sampling_params_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**bad)
