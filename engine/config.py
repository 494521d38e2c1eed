"""Typed configuration of a Llama-family decoder, read from a Hugging Face ``config.json``.

One frozen dataclass holds everything the forward pass needs. It is built
either directly (tiny random models for tests and benchmarks, see
:meth:`ModelArch.tiny`) or from a checkpoint directory with
:meth:`ModelArch.from_pretrained`, which understands both spellings of the
rotary settings that ``config.json`` files use: the older top-level
``rope_theta`` + ``rope_scaling`` and the newer ``rope_parameters``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

RopeType = Literal["default", "linear", "llama3"]

#: ``architectures[0]`` values this engine can run, and whether the q/k/v
#: projections carry a bias regardless of ``attention_bias`` (Qwen2 does).
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}


LAYER_TYPES = ("full_attention", "sliding_attention")
"""``config.json`` ``layer_types`` entries this engine runs."""


class CheckpointError(ValueError):
    """A checkpoint directory or its ``config.json`` cannot be used; the message names what and where."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling.

    ``default`` leaves frequencies alone; ``linear`` divides every frequency by
    ``factor``; ``llama3`` divides only the low frequencies and blends the
    middle band (Llama 3.1's long-context recipe).
    """

    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArch:
    """Shape and numerics of a Llama-architecture decoder.

    ``num_kv_heads < num_heads`` is grouped-query attention; each KV head
    serves ``num_heads // num_kv_heads`` query heads.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    """Per layer ``full_attention`` or ``sliding_attention`` (Gemma-style alternation, Qwen2's
    ``max_window_layers``); ``None``: every layer windowed when ``sliding_window`` is set (Mistral)."""
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArch.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelArch.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelArch.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"ModelArch.layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_layers} layers")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"ModelArch.layer_types {unknown} not supported; supported: {list(LAYER_TYPES)}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"ModelArch.sliding_window must be a positive int, got {self.sliding_window!r}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"ModelArch.architecture {self.architecture!r} is not supported; "
                f"choose one of {sorted(SUPPORTED_ARCHITECTURES)}"
            )

    @property
    def max_model_len(self) -> int:
        """Longest sequence this model takes (a sliding window does not cap it: older keys are just not seen)."""
        return self.max_position_embeddings

    def window(self, layer: int) -> int:
        """Keys layer ``layer`` attends to (its query's and the ``window - 1`` before it); 0: all of them."""
        if self.sliding_window is None:
            return 0
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return 0

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """:meth:`window` of every layer."""
        return tuple(self.window(i) for i in range(self.num_layers))

    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v projections have a bias (``attention_bias`` or a Qwen2-style architecture)."""
        return self.attention_bias or SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def tiny(cls, *, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
             hidden_size: int = 64, intermediate_size: int = 128, vocab_size: int = 260,
             tie_word_embeddings: bool = False, attention_bias: bool = False) -> ModelArch:
        """A small config for tests and benchmarks.

        The default vocabulary fits the byte tokenizer, whose BOS (256) and EOS
        (257) become the model's special tokens when the vocabulary holds them.
        """
        byte_specials = vocab_size >= 258
        return cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                   num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings,
                   attention_bias=attention_bias, bos_token_id=256 if byte_specials else None,
                   eos_token_ids=(257,) if byte_specials else ())

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelArch:
        """Build from the parsed contents of a Hugging Face ``config.json``; ``source`` names it in errors."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{source}: architecture {arch!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            theta, scaling = _rope_settings(cfg, source)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
            layers = int(cfg["num_hidden_layers"])
            types = cfg.get("layer_types")
            if window and not types and arch == "Qwen2ForCausalLM":  # Qwen2 windows the layers from max_window_layers on
                first = int(cfg.get("max_window_layers", layers))
                types = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                sliding_window=int(window) if window else None,
                layer_types=tuple(types) if types and window else None,
                architecture=arch,
            )
        except KeyError as exc:
            raise CheckpointError(f"{source}: missing required field {exc.args[0]!r}") from exc
        except CheckpointError:
            raise
        except ValueError as exc:  # a field ModelArch refuses (layer_types, sizes): name the file
            raise CheckpointError(f"{source}: {exc}") from exc

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelArch:
        """Read ``<path>/config.json``. Raises :class:`CheckpointError` naming the missing or bad file."""
        directory = Path(path)
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist")
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"checkpoint directory {str(directory)!r} has no config.json")
        try:
            cfg = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from exc
        return cls.from_hf_dict(cfg, source=str(config_file))


def _rope_settings(cfg: dict[str, Any], source: str) -> tuple[float, RopeScaling]:
    """``(rope_theta, scaling)`` from either ``rope_parameters`` or ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise CheckpointError(
            f"{source}: rope_type {rope_type!r} is not supported; supported: 'default', 'linear', 'llama3'"
        )
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
    return theta, scaling
