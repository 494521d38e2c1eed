"""The KV layout an engine gives a model: the model's shape, the engine's block size and dtype, the weights' identity.

The layout's fingerprint roots every block key and is what a daemon checks at
login, so this is the one place that decides it (``LLM`` builds its pool with
it; ``kvstore demo`` sizes its host tier with it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine.config import ModelArch
from engine.engine_config import EngineConfig
from engine.model_id import checkpoint_identity
from kvstore.layout import KVLayout


def engine_kv_layout(arch: ModelArch, config: EngineConfig, model: str | Path | None = None,
                     model_id: str | None = None) -> KVLayout:
    """The layout of ``arch`` under ``config`` (block size; dtype with ``auto`` resolved on its device).

    ``model_id`` defaults to the checkpoint ``model``'s identity
    (:func:`engine.model_id.checkpoint_identity`), or
    ``builtin-random-seed<config.seed>`` for the built-in model (``model`` None), with a digest of ``arch``
    when it is not :meth:`ModelArch.tiny`'s (another shape or sliding windows computes other KV).
    Reads a checkpoint's files only to derive its identity; changes nothing.
    """
    if not model_id:
        if model is not None:
            model_id = checkpoint_identity(model)
        else:
            model_id = f"builtin-random-seed{config.seed}"
            if arch != ModelArch.tiny():
                model_id += "-" + hashlib.blake2b(repr(arch).encode(), digest_size=8).hexdigest()
    return KVLayout(arch.num_layers, arch.num_kv_heads, arch.head_dim, config.block_size, config.kv_dtype_name(),
                    model_id=model_id)
