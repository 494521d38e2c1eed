"""Model config parsing (both rotary spellings) and clear errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, CheckpointError, EngineConfig, ModelArch
from engine.kernels import select_backend
from engine.rope import inverse_frequencies
from engine.weights import build_model, init_random, load_model, save_checkpoint

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}


def test_old_and_new_rope_spellings_agree() -> None:
    old = ModelArch.from_hf_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    new = ModelArch.from_hf_dict({**BASE, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling.rope_type == "llama3"
    assert (old.head_dim, old.num_kv_heads, old.qkv_bias) == (8, 2, False)


def test_rope_scaling_changes_only_what_it_should() -> None:
    cfg = ModelArch.from_hf_dict({**BASE, "rope_scaling": {"type": "linear", "factor": 4.0}})
    plain = inverse_frequencies(16, 10000.0, ModelArch.from_hf_dict(BASE).rope_scaling)
    torch.testing.assert_close(inverse_frequencies(16, 10000.0, cfg.rope_scaling), plain / 4)
    llama3 = ModelArch.from_hf_dict({**BASE, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    scaled = inverse_frequencies(16, 10000.0, llama3.rope_scaling)
    assert scaled[0] == plain[0]                      # the highest frequency is untouched
    torch.testing.assert_close(scaled[-1], plain[-1] / 8)  # the lowest is divided by the factor


def test_qwen2_has_qkv_bias_and_sliding_windows_are_read_per_layer() -> None:
    qwen = ModelArch.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
                                     "sliding_window": 128})
    assert qwen.qkv_bias and qwen.sliding_window is None and qwen.layer_windows == (0, 0)
    mistral = ModelArch.from_hf_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 128,
                                        "max_position_embeddings": 4096})
    assert mistral.max_model_len == 4096 and mistral.layer_windows == (128, 128)  # a window caps no length
    old_qwen = ModelArch.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                                         "sliding_window": 64, "max_window_layers": 1})
    assert old_qwen.layer_windows == (0, 64)  # no layer_types: windowed from max_window_layers on
    gemma_style = ModelArch.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "sliding_window": 32,
                                            "layer_types": ["sliding_attention", "full_attention"]})
    assert gemma_style.layer_windows == (32, 0)
    with pytest.raises(CheckpointError, match=r"layer_types \['linear_attention'\] not supported"):
        ModelArch.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "sliding_window": 32,
                                "layer_types": ["linear_attention", "full_attention"]})


def test_checkpoint_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="has no config.json"):
        ModelArch.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        ModelArch.from_pretrained(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="architecture 'GPT2LMHeadModel' is not supported"):
        LLM(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in BASE.items() if k != "hidden_size"}))
    with pytest.raises(CheckpointError, match="missing required field 'hidden_size'"):
        ModelArch.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "rope_scaling": {"rope_type": "yarn"}}))
    with pytest.raises(CheckpointError, match="rope_type 'yarn'"):
        ModelArch.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(tmp_path, torch.float32, "cpu")


def test_checkpoint_with_wrong_shapes_or_missing_tensors(tmp_path: Path) -> None:
    model = build_model(ModelArch.tiny(), torch.float32, "cpu")
    init_random(model, 3)
    save_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(CheckpointError, match="mlp.*has shape"):
        load_model(tmp_path, torch.float32, "cpu")
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="lacks tensors: model.layers.2"):
        load_model(tmp_path, torch.float32, "cpu")


def test_saved_checkpoint_round_trips(tmp_path: Path) -> None:
    model = build_model(ModelArch.tiny(tie_word_embeddings=True, attention_bias=True), torch.float32, "cpu")
    init_random(model, 4)
    save_checkpoint(model, tmp_path)
    loaded = load_model(tmp_path, torch.float32, "cpu")
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_unknown_backend_and_bad_engine_config() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'cutlass'"):
        select_backend("cutlass", "cpu")
    with pytest.raises(ValueError, match="EngineConfig.backend 'flash'"):
        EngineConfig(backend="flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="EngineConfig.block_size"):
        EngineConfig(block_size=0)
    assert select_backend("auto", "cpu").name == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", "cpu")


def test_requests_that_can_never_fit_are_rejected() -> None:
    llm = LLM(config=EngineConfig(block_size=4, num_gpu_blocks=4, dtype="float32"))
    from engine import SamplingParams
    with pytest.raises(ValueError, match="needs up to 5 KV blocks; the pool has 4"):
        llm.add_request([1] * 10, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request([1, 9999], SamplingParams(max_tokens=1))
