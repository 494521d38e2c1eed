"""A real vLLM ``Scheduler`` with a KV connector, on CPU, without a model or a GPU.

What a test drives is vLLM's own scheduler, KV cache manager and connector
code; only the model runner is replaced, by :func:`runner_output`, which
says what a step "computed" (one sampled token per scheduled request) and
what the connector's worker side reported (``finished_recving``,
``finished_sending``, ``invalid_block_ids``). The model is a directory with
a tiny ``config.json`` (``HF_HUB_OFFLINE=1``: nothing is downloaded).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK_SIZE = 16
"""vLLM's GPU block size in these tests (tokens)."""
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 16
EOS = 2


def model_dir(root: Path, name: str = "tiny-llama", layers: int = NUM_LAYERS) -> Path:
    """A local model directory holding only a tiny Llama ``config.json``; returns its path."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": NUM_KV_HEADS * HEAD_DIM * 2, "intermediate_size": 64,
        "num_attention_heads": NUM_KV_HEADS * 2, "num_key_value_heads": NUM_KV_HEADS,
        "num_hidden_layers": layers, "vocab_size": 1000, "max_position_embeddings": 1024,
        "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": EOS,
    }))
    return path


def vllm_config(model: Path, connector: dict[str, Any], num_gpu_blocks: int = 64,
                max_num_batched_tokens: int = 1024) -> VllmConfig:
    """A ``VllmConfig`` for ``model`` with prefix caching on and ``connector`` as the KV transfer config."""
    model_config = ModelConfig(model=str(model), tokenizer=str(model), skip_tokenizer_init=True,
                               dtype="float16", max_model_len=1024, seed=0)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=True)
    cache_config.num_gpu_blocks = num_gpu_blocks
    scheduler_config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=1024, enable_chunked_prefill=True,
                                       is_encoder_decoder=False)
    return VllmConfig(model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config,
                      kv_transfer_config=KVTransferConfig(**connector), device_config=DeviceConfig("cpu"))


def make_kv_cache_config(config: VllmConfig, num_gpu_blocks: int = 64) -> KVCacheConfig:
    """A KV cache of ``num_gpu_blocks`` blocks, one full-attention group over every layer of the model."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(config.model_config.get_num_layers(config.parallel_config))]
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=torch.float16)
    return KVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * num_gpu_blocks * len(layers), layers=layers,
                                        layer_stride=spec.page_size_bytes * num_gpu_blocks,
                                        block_stride=spec.page_size_bytes)],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


def make_scheduler(config: VllmConfig, num_gpu_blocks: int = 64) -> Scheduler:
    """vLLM's scheduler over :func:`make_kv_cache_config`'s KV cache."""
    return Scheduler(vllm_config=config, kv_cache_config=make_kv_cache_config(config, num_gpu_blocks), block_size=BLOCK_SIZE,
                     structured_output_manager=StructuredOutputManager(config), log_stats=True)


_hasher_ready = False


def make_request(req_id: str, prompt: list[int], max_tokens: int = 1, cache_salt: str | None = None) -> Request:
    """A request for ``prompt`` (token ids) with vLLM's block hasher (sha256, as ``vllm serve`` uses)."""
    global _hasher_ready
    if not _hasher_ready:
        init_none_hash(__import__("vllm.utils.hashing", fromlist=["sha256"]).sha256)
        _hasher_ready = True
    from vllm.utils.hashing import sha256

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
                   pooling_params=None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


def runner_output(sched_out: Any, finished_recving: Iterable[str] = (), finished_sending: Iterable[str] = (),
                  invalid_block_ids: Iterable[int] = (), token: int = 7) -> ModelRunnerOutput:
    """What a model runner returns for ``sched_out``: one sampled ``token`` per request that reached its prompt end."""
    req_ids = list(sched_out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids], logprobs=None, prompt_logprobs_dict={}, pooler_output=[],
        kv_connector_output=KVConnectorOutput(finished_sending=set(finished_sending) or None,
                                              finished_recving=set(finished_recving) or None,
                                              invalid_block_ids=set(invalid_block_ids)),
    )
