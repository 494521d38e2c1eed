"""A Llama-architecture decoder whose attention is supplied per forward pass.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` exactly
(``model.layers.0.self_attn.q_proj.weight`` ...), so a checkpoint's
safetensors load by name with no mapping table.

The model does not own a KV cache. Every forward takes an
:class:`AttentionContext` that, for each layer, receives the rotated
``q, k, v`` of the new tokens and returns the attention output: the paged
context writes K/V into the GPU block pool and attends over the sequence's
blocks; the dense context (the test oracle) attends with a full causal mask
and stores nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelArch
from engine.rope import RotaryEmbedding

BeforeLayer = Callable[[int], None]


class AttentionContext(Protocol):
    """Computes attention for one layer of one batch."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [T, H, D]``, ``k, v [T, KVH, D]`` of the new tokens -> output ``[T, H, D]``."""
        ...


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 like the reference implementation."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class SelfAttention(nn.Module):
    """Projections and rotary embedding around an external attention kernel."""

    def __init__(self, cfg: ModelArch, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        out = ctx.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, cfg: ModelArch, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Embedding, the layer stack and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelArch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head (tied to the embedding when the config says so)."""

    def __init__(self, cfg: ModelArch) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                before_layer: BeforeLayer | None = None) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of a flat batch of tokens.

        ``input_ids`` and ``positions`` are 1-D over all tokens of the batch.
        ``before_layer(i)``, when given, is called before layer ``i`` runs, so a
        caller can wait until that layer's KV blocks have arrived (an
        asynchronous load from a lower tier) while earlier layers compute.
        """
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            if before_layer is not None:
                before_layer(i)
            x = layer(x, positions, self.rope, ctx)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 for the given hidden-state rows."""
        return self.lm_head(hidden).float()


class DenseCausalAttention:
    """The oracle: full causal attention over each sequence's own tokens, no cache.

    ``seq_lens`` splits the flat batch into independent sequences that each
    start at position 0. Written with plain matrix products so it shares no
    code with the paged kernels it checks.
    """

    def __init__(self, seq_lens: list[int], windows: tuple[int, ...] = ()) -> None:
        """``windows``: each layer's sliding window (0 or absent: full causal attention)."""
        self.seq_lens = list(seq_lens)
        self.windows = windows

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        outs = []
        start = 0
        for n in self.seq_lens:
            qs = q[start:start + n].float().transpose(0, 1)
            ks = k[start:start + n].float().repeat_interleave(group, dim=1).transpose(0, 1)
            vs = v[start:start + n].float().repeat_interleave(group, dim=1).transpose(0, 1)
            scores = qs @ ks.transpose(1, 2) / (q.shape[-1] ** 0.5)
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            window = self.windows[layer] if layer < len(self.windows) else 0
            if window:
                mask &= ~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-window)
            scores = scores.masked_fill(~mask, float("-inf"))
            outs.append((scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype))
            start += n
        return torch.cat(outs, dim=0)


def dense_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits ``[len, vocab]`` of one sequence by a dense forward pass (no cache)."""
    device = model.lm_head.weight.device
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(len(token_ids), device=device)
    hidden = model(ids, positions, DenseCausalAttention([len(token_ids)], model.config.layer_windows))
    return model.compute_logits(hidden)
