"""Model weights: seeded random initialisation, and safetensors checkpoints in Hugging Face layout.

Parameter names equal the checkpoint's tensor names, so loading is a lookup
by name with a shape check. Nothing is ever downloaded: a checkpoint is a
local directory holding ``config.json`` and one or more ``*.safetensors``
files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.config import CheckpointError, ModelArch
from engine.model import LlamaForCausalLM


def build_model(cfg: ModelArch, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
    """An uninitialised model (parameters on ``device`` in ``dtype``), in eval mode."""
    model = LlamaForCausalLM(cfg)
    return model.to(device=device, dtype=dtype).eval()


def init_random(model: LlamaForCausalLM, seed: int, std: float = 0.05) -> None:
    """Fill every parameter deterministically from ``seed``: norms at 1, biases and matrices ~ N(0, std).

    Values are drawn on the CPU in fp32 and copied, so the same seed gives the
    same model on every device and dtype.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                values = torch.ones(param.shape)
            else:
                values = torch.randn(param.shape, generator=gen) * std
            param.copy_(values)


def load_safetensors(model: LlamaForCausalLM, directory: str | Path) -> None:
    """Copy the tensors of every ``*.safetensors`` file in ``directory`` into ``model``.

    Raises :class:`CheckpointError` naming the file when no safetensors file
    exists, when a file is unreadable (truncated, not safetensors), when a
    parameter is missing (a tied ``lm_head`` may be absent), or when a shape
    disagrees with the config.
    """
    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint directory {str(directory)!r} has no *.safetensors files")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except SafetensorError as exc:
                # A truncated or foreign file fails here, before any tensor is copied.
                raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
            with handle as f:
                for name in f.keys():
                    if name not in params:
                        # Rotary caches and tied heads written by some exporters carry no information.
                        continue
                    try:
                        tensor = f.get_tensor(name)
                    except SafetensorError as exc:
                        raise CheckpointError(f"{file}: tensor {name!r} is unreadable ({exc})") from exc
                    if tuple(tensor.shape) != tuple(params[name].shape):
                        raise CheckpointError(
                            f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"config expects {tuple(params[name].shape)}"
                        )
                    params[name].copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"checkpoint {str(directory)!r} lacks tensors: {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def save_checkpoint(model: LlamaForCausalLM, directory: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` in Hugging Face layout (loadable by transformers)."""
    cfg = model.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rope: dict[str, object] = {"rope_type": cfg.rope_scaling.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling.rope_type != "default":
        rope.update(factor=cfg.rope_scaling.factor, low_freq_factor=cfg.rope_scaling.low_freq_factor,
                    high_freq_factor=cfg.rope_scaling.high_freq_factor,
                    original_max_position_embeddings=cfg.rope_scaling.original_max_position_embeddings)
    config = {
        "architectures": [cfg.architecture],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                       "Qwen2ForCausalLM": "qwen2"}[cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: p.detach().to("cpu", torch.float32).contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def load_model(directory: str | Path, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
    """Config and weights of a local checkpoint directory, as a ready model."""
    cfg = ModelArch.from_pretrained(directory)
    model = build_model(cfg, dtype, device)
    load_safetensors(model, directory)
    return model
