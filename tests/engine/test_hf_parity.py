"""Against an implementation nobody here wrote: Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from engine.model import dense_logits  # noqa: E402
from engine.weights import load_model  # noqa: E402

from engine_testlib import PagedHarness, random_tokens  # noqa: E402

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


def _llama() -> torch.nn.Module:
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    cfg = transformers.LlamaConfig(**COMMON, rope_parameters=rope, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def _qwen2() -> torch.nn.Module:
    cfg = transformers.Qwen2Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                   tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(cfg)


def _mistral() -> torch.nn.Module:
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    cfg = transformers.MistralConfig(**COMMON, rope_parameters=rope, sliding_window=None, head_dim=24)
    return transformers.MistralForCausalLM(cfg)


def _mistral_window() -> torch.nn.Module:
    """Every layer attends to the last 5 keys: shorter than every prompt and generation below."""
    cfg = transformers.MistralConfig(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                     sliding_window=5, head_dim=16)
    return transformers.MistralForCausalLM(cfg)


def _qwen2_window() -> torch.nn.Module:
    """Layer 0 full attention, layer 1 a 6-key window (Qwen2's ``max_window_layers``; Gemma-style alternation)."""
    cfg = transformers.Qwen2Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                   use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    return transformers.Qwen2ForCausalLM(cfg)


@pytest.fixture(scope="module", params=[_llama, _qwen2, _mistral, _mistral_window, _qwen2_window],
                ids=["llama3-rope", "qwen2-bias-tied", "mistral", "mistral-window5", "qwen2-full-then-window6"])
def hf_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A tiny random HF model (weights perturbed so norms and biases are not trivial) saved to a directory."""
    torch.manual_seed(0)
    model = request.param().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    directory = tmp_path_factory.mktemp(request.param.__name__.strip("_"))
    model.save_pretrained(directory)
    return model, Path(directory)


def test_logits_match_transformers(hf_checkpoint) -> None:
    hf_model, directory = hf_checkpoint
    ours = load_model(directory, torch.float32, "cpu")
    tokens = random_tokens(23, seed=7, vocab=300)
    with torch.no_grad():
        expect = hf_model(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(dense_logits(ours, tokens), expect, atol=1e-4, rtol=1e-4)
    h = PagedHarness(ours, block_size=4)
    seq = h.new_seq(tokens)
    paged = torch.cat([h.run([(seq, n)])[0] for n in (10, 6, 1, 1, 5)])
    torch.testing.assert_close(paged, expect, atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers(hf_checkpoint) -> None:
    hf_model, directory = hf_checkpoint
    prompt = random_tokens(9, seed=8, vocab=300)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    llm = LLM(directory, config=EngineConfig(block_size=4, num_gpu_blocks=16, dtype="float32"))
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    assert out.token_ids == ids[len(prompt):]
    assert llm.arch.architecture == hf_model.config.architectures[0]
