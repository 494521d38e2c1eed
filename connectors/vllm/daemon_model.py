"""The daemon ``model:`` section a vLLM engine with kvstore's full connector needs, from the checkpoint alone.

A ``kvstore serve`` daemon serves one block layout, and the full connector's
layout is one vLLM block of every layer (:func:`connectors.vllm.connector.block_layout`).
For a decoder whose every layer has full attention (or every layer the same
sliding window) with the same K/V heads, or MLA (DeepSeek-V2/V3:
``kv_lora_rank`` + ``qk_rope_head_dim`` per token),
the section follows from ``config.json`` and the engine's settings without
starting vLLM::

    python -m connectors.vllm.daemon_model MODEL_DIR --dtype float32 --block-size 32 [--kv-cache-dtype fp8_e4m3]

A daemon started with another section refuses the engine at start, and the
error prints the section the engine needs (the authoritative answer for
any model this function does not describe).
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import groupby
from pathlib import Path
from typing import Any

import yaml

from connectors.engine_keys import engine_layout
from connectors.engine_store import daemon_model_section
from connectors.vllm.identity import kv_format, model_identity

_TENSOR_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}


def kv_tensor_dtype(dtype: str, kv_cache_dtype: str) -> str:
    """The KV tensors' dtype: ``uint8`` for every fp8 format (vLLM's storage), else the model's dtype."""
    return "uint8" if kv_cache_dtype.startswith("fp8") else dtype


_KINDS = {"full_attention": "FullAttentionSpec", "sliding_attention": "SlidingWindowSpec"}
"""``config.json`` ``layer_types`` entries and the KV cache spec vLLM gives such a layer."""


def _layer_kinds(cfg: dict[str, Any], layers: int, model: str | Path) -> str:
    """The layout's layer kinds (as :func:`connectors.vllm.connector.block_layout` names them, in model order).

    ``layer_types`` (Gemma 3 and other hybrids) names each layer; without it, a ``sliding_window`` windows
    every layer (Mistral-style). Raises ``ValueError`` for a layer kind whose cache is not attention K/V."""
    types = cfg.get("layer_types")
    if not types:
        windowed = cfg.get("sliding_window") and cfg.get("use_sliding_window", True)
        return "SlidingWindowSpec" if windowed else "FullAttentionSpec"
    other = sorted(set(types) - set(_KINDS))
    if other:
        raise ValueError(f"{model}: layer types {other} keep state that is not per-token K/V; kvstore's vLLM "
                         f"connector stores attention layers only")
    kinds = [_KINDS[t] for t in types[:layers]]
    if len(set(kinds)) == 1:
        return kinds[0]
    return ",".join(f"{k}*{len(list(run))}" for k, run in groupby(kinds))


def vllm_daemon_model(model: str | Path, dtype: str, block_size: int, kv_cache_dtype: str = "auto",
                      model_id: str | None = None, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """The ``model:`` section (as a dict) for vLLM blocks of the local checkpoint ``model``.

    ``dtype`` is vLLM's ``--dtype`` (``float32``, ``bfloat16``, ``float16``; not ``auto``),
    ``block_size`` its ``--block-size``, ``kv_cache_dtype`` its ``--kv-cache-dtype``,
    ``model_id`` the connector's ``model_id`` override, ``tensor_parallel_size`` its
    ``--tensor-parallel-size`` (a rank's shard: the K/V heads divided among the ranks; every rank
    uses the same daemon). Raises ``ValueError`` naming the field for a dtype it does not know, a
    missing or unreadable ``config.json``, one without head counts, or heads the ranks cannot share.
    """
    config = Path(model) / "config.json"
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config}: cannot read the checkpoint's config ({exc})") from None
    tensor = kv_tensor_dtype(dtype, kv_cache_dtype)
    if tensor not in _TENSOR_BYTES:
        raise ValueError(f"dtype {dtype!r}: give float32, bfloat16 or float16")
    try:
        layers = int(cfg["num_hidden_layers"])
        if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3): one latent vector (compressed KV + rope key) per token
            spec, page = "MLAAttentionSpec", block_size * (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"]))
        else:
            heads = int(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
            head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
            if heads % tensor_parallel_size:
                raise ValueError(f"{model}: {heads} K/V heads cannot be split among {tensor_parallel_size} ranks")
            spec = _layer_kinds(cfg, layers, model)
            page = 2 * block_size * (heads // tensor_parallel_size) * head_dim
    except KeyError as exc:
        raise ValueError(f"{model}/config.json has no {exc.args[0]!r}; start vLLM with the connector once and "
                         f"take the section from the daemon's refusal") from None
    page *= _TENSOR_BYTES[tensor]
    layout = engine_layout("vllm-blocks", model_identity(str(model), None, model_id), f"torch.{tensor}", block_size,
                           page * layers, f"layers={layers}|{spec}|{kv_format(kv_cache_dtype, tensor)}"
                           + (f"|tp={tensor_parallel_size}" if tensor_parallel_size > 1 else ""))
    return dict(yaml.safe_load(daemon_model_section(layout))["model"])


def main(argv: list[str] | None = None) -> int:
    """Print the section for a daemon's config (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m connectors.vllm.daemon_model",
                                description="Print the kvstore daemon `model:` section a vLLM engine with "
                                            "KVStoreConnector needs (full-attention decoders).")
    p.add_argument("model", help="local checkpoint directory (vLLM's --model)")
    p.add_argument("--dtype", required=True, choices=["float32", "bfloat16", "float16"], help="vLLM's --dtype")
    p.add_argument("--block-size", type=int, required=True, help="vLLM's --block-size (CPU: a multiple of 32)")
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype (default: auto)")
    p.add_argument("--model-id", help="the connector's kv_connector_extra_config model_id, if set")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's --tensor-parallel-size (default 1)")
    a = p.parse_args(argv)
    try:
        section = vllm_daemon_model(a.model, a.dtype, a.block_size, a.kv_cache_dtype, a.model_id,
                                    a.tensor_parallel_size)
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    sys.stdout.write(yaml.safe_dump({"model": section}, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
