"""Llama-architecture GGUF checkpoints (llama.cpp's format): model shape from the metadata, weights by name.

GGUF names map onto the engine's Hugging Face parameter names::

    token_embd                -> model.embed_tokens          output_norm -> model.norm
    output (absent when tied) -> lm_head                     blk.N.attn_norm -> model.layers.N.input_layernorm
    blk.N.attn_q/k/v/output   -> ...self_attn.q/k/v/o_proj    blk.N.ffn_norm  -> ...post_attention_layernorm
    blk.N.ffn_gate/up/down    -> ...mlp.gate/up/down_proj

llama.cpp's converter reorders the rows of ``attn_q`` and ``attn_k`` within
each head from the ``rotate_half`` layout of Hugging Face checkpoints (first
half of the head's dimensions, then second half) to interleaved pairs (its
rotary kernel rotates adjacent elements). :func:`unpermute_rows` undoes that,
so the engine's rotary embedding applies unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.config import CheckpointError, ModelArch
from engine.gguf_file import GGUFFile
from engine.model import LlamaForCausalLM

#: GGUF tensor name (``{i}`` = layer) -> engine parameter name.
LAYER_TENSORS: dict[str, str] = {
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def is_gguf_path(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file: a ``.gguf`` name (existing or not) or a file with the GGUF magic."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"


def checkpoint_config(model: str | Path, gguf: GGUFFile | None = None) -> ModelArch:
    """The shape of the checkpoint at ``model``: a GGUF file's metadata (``gguf`` when already opened) or a
    checkpoint directory's ``config.json``. Reads no weights."""
    if gguf is None and is_gguf_path(model):
        gguf = GGUFFile(model)
    return config_from_gguf(gguf) if gguf is not None else ModelArch.from_pretrained(model)


def config_from_gguf(gguf: GGUFFile) -> ModelArch:
    """The model shape from ``llama.*`` metadata; tied embeddings when the file has no ``output.weight``.

    Raises :class:`CheckpointError` naming the file and key for another
    architecture, a missing key, or a rotary setting the engine does not implement.
    """
    arch = gguf.require("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{gguf.path}: general.architecture {arch!r} is not supported (only 'llama')")
    hidden = int(gguf.require("llama.embedding_length"))
    heads = int(gguf.require("llama.attention.head_count"))
    head_dim = hidden // heads
    rope_dims = int(gguf.field("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise CheckpointError(f"{gguf.path}: llama.rope.dimension_count {rope_dims} differs from the head size "
                              f"{head_dim}; partial rotary embeddings are not supported")
    scaling = gguf.field("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise CheckpointError(f"{gguf.path}: llama.rope.scaling.type {scaling!r} is not supported")
    vocab = gguf.field("llama.vocab_size")
    if vocab is None:  # older converters leave it to the tokenizer's vocabulary
        vocab = len(gguf.require("tokenizer.ggml.tokens"))
    eos = [gguf.field(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return ModelArch(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(gguf.require("llama.feed_forward_length")),
        num_layers=int(gguf.require("llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(gguf.field("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(gguf.require("llama.context_length")),
        rms_norm_eps=float(gguf.require("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(gguf.field("llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=gguf.field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order of a q or k projection ``[num_heads * head_dim, in]``.

    The converter wrote row ``2j + s`` of a head from row ``s * head_dim/2 + j``
    (``s`` in {0, 1}); reading it back is the transpose of that index map.
    """
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def load_gguf_weights(model: LlamaForCausalLM, gguf: GGUFFile) -> None:
    """Dequantize every tensor of ``gguf`` into ``model`` (each tensor once); changes ``model``'s parameters.

    Raises :class:`CheckpointError` naming the file and tensor when one is
    missing or its shape disagrees with the model.
    """
    cfg = model.config
    names = dict(GLOBAL_TENSORS)
    if cfg.tie_word_embeddings:
        del names["output.weight"]
    for i in range(cfg.num_layers):
        names.update({src.format(i=i): dst.format(i=i) for src, dst in LAYER_TENSORS.items()})
    params = dict(model.named_parameters())
    with torch.no_grad():
        for src, dst in names.items():
            values = gguf.tensor(src)
            if src.endswith("attn_q.weight"):
                values = unpermute_rows(values, cfg.num_heads)
            elif src.endswith("attn_k.weight"):
                values = unpermute_rows(values, cfg.num_kv_heads)
            param = params[dst]
            if tuple(values.shape) != tuple(param.shape):
                raise CheckpointError(f"{gguf.path}: tensor {src!r} has shape {tuple(values.shape)}, "
                                      f"the metadata implies {tuple(param.shape)}")
            param.copy_(torch.from_numpy(values))
