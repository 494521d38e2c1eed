"""Capacity planning: KV bytes per token, tokens per tier, and time to load a prefix from each tier.

``bytes/token = num_layers x 2 (K, V) x num_kv_heads x head_dim x itemsize``;
Llama-3.1-70B in BF16: 80 x 2 x 8 x 128 x 2 = 327,680 B (0.31 MiB), so a
128k-token context is 40 GiB. Load time = prefix bytes / tier bandwidth
(a transfer model: no latency term, no overlap with compute).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvstore.layout import KVLayout

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache size depends on."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * ITEMSIZE[self.dtype]

    def layout(self, block_size: int) -> KVLayout:
        """The :class:`KVLayout` of this model with ``block_size``-token blocks."""
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, block_size,
                        self.dtype, model_id=self.name)  # type: ignore[arg-type]


PRESETS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("llama-3.1-8b", 32, 8, 128),
    ModelShape("llama-3.1-70b", 80, 8, 128),
    ModelShape("llama-3.1-405b", 126, 8, 128),
    ModelShape("qwen2.5-7b", 28, 4, 128),
    ModelShape("qwen2.5-72b", 80, 8, 128),
    ModelShape("mistral-7b", 32, 8, 128),
    ModelShape("smollm2-135m", 30, 3, 64),  # the engine's default model (bf16 on CUDA)
    ModelShape("kvstore-tiny", 4, 4, 64, "float16"),
)}
"""Model shapes by name (from each model's published ``config.json``)."""


def load_model(spec: str) -> ModelShape:
    """A preset name, or the path of a Hugging Face ``config.json``; ``ValueError`` names what is wrong."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    try:
        cfg = json.loads(path.read_text())
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a usable model config.json ({type(exc).__name__}: {exc})") from None
    dtype = str(cfg.get("torch_dtype", "bfloat16"))
    if dtype not in ITEMSIZE:
        raise ValueError(f"{path}: torch_dtype {dtype!r} is not one of {sorted(ITEMSIZE)}")
    return ModelShape(str(cfg.get("_name_or_path") or path.parent.name or path.stem), layers, kv_heads, head_dim, dtype)


@dataclass(frozen=True)
class TierPlan:
    """One tier's share of the plan."""

    tier: str
    capacity_bytes: int
    bandwidth_gbps: float | None
    """Bandwidth the prefix is loaded at, in GB/s (1e9 B/s); ``None`` for the GPU (already in place)."""

    def tokens(self, bytes_per_token: int) -> int:
        """Tokens whose KV fits in this tier."""
        return self.capacity_bytes // bytes_per_token

    def load_seconds(self, nbytes: int) -> float:
        """Seconds to bring ``nbytes`` from this tier to the GPU (0 for the GPU)."""
        return 0.0 if self.bandwidth_gbps is None else nbytes / (self.bandwidth_gbps * 1e9)


@dataclass(frozen=True)
class Plan:
    """A model on a machine's tiers."""

    model: ModelShape
    tiers: tuple[TierPlan, ...]
    prefix_tokens: int

    def rows(self) -> list[dict[str, object]]:
        """One dict per tier: capacity, tokens that fit, bandwidth, prefix load time."""
        bpt = self.model.bytes_per_token
        prefix_bytes = self.prefix_tokens * bpt
        return [{"tier": t.tier, "capacity_bytes": t.capacity_bytes, "tokens": t.tokens(bpt),
                 "bandwidth_GBps": t.bandwidth_gbps, "prefix_load_s": t.load_seconds(prefix_bytes)}
                for t in self.tiers]

    def render(self) -> str:
        """The plan as a plain-text table."""
        from kvstore.config.units import format_size  # pydantic, there: `kvstore --help` imports this module

        bpt = self.model.bytes_per_token
        m = self.model
        lines = [
            f"model {m.name}: {m.num_layers} layers x {m.num_kv_heads} KV heads x head_dim {m.head_dim}, {m.dtype}",
            f"KV bytes per token: {bpt:,} B ({bpt / 2**20:.3f} MiB, {bpt / 1e6:.3f} MB)",
            f"prefix of {self.prefix_tokens:,} tokens: {self.prefix_tokens * bpt / 2**30:.2f} GiB",
            "",
            f"{'tier':<6} {'capacity':>12} {'tokens that fit':>16} {'bandwidth':>12} {'load prefix':>12}",
        ]
        for row in self.rows():
            bw = row["bandwidth_GBps"]
            bw_text = "in place" if bw is None else f"{bw:.2f} GB/s"
            load = float(row["prefix_load_s"])  # type: ignore[arg-type]
            lines.append(f"{row['tier']:<6} {format_size(int(row['capacity_bytes'])):>12} "  # type: ignore[call-overload]
                         f"{int(row['tokens']):>16,} {bw_text:>12} {load * 1e3:>9.1f} ms")  # type: ignore[call-overload]
        return "\n".join(lines)


def make_plan(model: ModelShape, gpu_bytes: int, host_bytes: int, disk_bytes: int,
              host_gbps: float, disk_gbps: float, prefix_tokens: int) -> Plan:
    """Plan ``model`` on the given tier sizes and bandwidths."""
    tiers = (TierPlan("gpu", gpu_bytes, None), TierPlan("host", host_bytes, host_gbps),
             TierPlan("disk", disk_bytes, disk_gbps))
    return Plan(model, tiers, prefix_tokens)
