"""What names a vLLM engine's KV bytes for kvstore: the weights, the KV cache format, the block geometry.

Two vLLM processes may share a kvstore block only when their KV bytes for the
same tokens are the same, so everything that decides those bytes goes into the
layout's model id (and so into every key's fingerprint):

- **the weights, not their path**: a local checkpoint is named by
  :func:`engine.model_id.weights_digest` (its ``config.json`` and sampled
  safetensors content), so the same weights under another path share blocks
  and a fine-tune swapped in under the same path does not; a Hub model by its
  repository id and the revision vLLM resolved. ``kv_connector_extra_config``'s
  ``model_id`` overrides both (for weights vLLM loads some other way);
- **the KV cache format**: vLLM keeps every fp8 format in ``uint8`` tensors,
  so the tensor dtype alone would let an ``fp8_e5m2`` engine read an
  ``fp8_e4m3`` engine's bytes; the ``--kv-cache-dtype`` value (which also
  decides vLLM's KV quantisation mode and where scales live) and the layers it
  skips are named too;
- **weight quantisation** (``--quantization``), which changes the KV vLLM computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from engine.model_id import weights_digest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec


def model_identity(model: str, revision: str | None = None, override: str | None = None) -> str:
    """The weights' name in kvstore keys (see the module docstring): ``override``, a content digest, or repo@revision.

    ``model`` and ``revision`` are vLLM's ``model_config.model`` and ``.revision``.
    """
    if override:
        return override
    path = Path(model)
    if path.exists():
        return f"weights@{weights_digest(path)}"
    return f"{model}@{revision or 'default'}"


def kv_format(cache_dtype: str, tensor_dtype: str, skip_layers: Sequence[str] = (),
              weights_quant: str | None = None) -> str:
    """Everything besides the weights and the geometry that decides a block's bytes (see the module docstring).

    ``cache_dtype``: ``--kv-cache-dtype`` (``auto``, ``fp8_e4m3``...; vLLM derives the KV quantisation
    mode from it, ``get_kv_quant_mode``); ``tensor_dtype``: the KV tensors' dtype; ``skip_layers``:
    layers kept unquantised; ``weights_quant``: ``--quantization``.
    """
    return (f"kv={cache_dtype}|tensor={tensor_dtype.removeprefix('torch.')}"
            f"|skip={','.join(skip_layers)}|weights_quant={weights_quant}")


def engine_kv_format(vllm_config: VllmConfig, spec: AttentionSpec) -> str:
    """:func:`kv_format` of a running engine's config and attention spec."""
    cache = vllm_config.cache_config
    return kv_format(str(cache.cache_dtype), str(spec.dtype),
                     list(getattr(cache, "kv_cache_dtype_skip_layers", None) or ()),
                     vllm_config.model_config.quantization)
