"""``LLM``: the engine's front door. Builds the model, the block pool and the scheduler; runs requests."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from engine.block_manager import BlockManager
from connectors.base import KVConnector
from engine.chat_template import ChatTemplate
from engine.config import ModelArch
from engine.connector_manager import ConnectorBlockManager, PreemptionMode
from engine.engine_config import EngineConfig
from engine.gguf_file import GGUFFile
from engine.gguf_loader import checkpoint_config, is_gguf_path, load_gguf_weights
from engine.kernels import select_backend
from engine.kv_layout import engine_kv_layout
from engine.outputs import RequestOutput
from engine.runner import ModelRunner
from engine.sampler import Sampler, check_stop
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import SequenceState
from engine.model_text import model_text
from engine.tokenizer import ByteTokenizer, HFTokenizer
from engine.weights import build_model, init_random, load_safetensors
from kvstore.store.gpu_pool import GPUBlockPool

Prompt = str | list[int]


class LLM:
    """A Llama-family model served from kvstore's GPU block pool with continuous batching.

    ``model`` is a local Hugging Face checkpoint directory (``config.json`` and
    ``*.safetensors``; ``tokenizer.json`` when present), a llama.cpp ``.gguf``
    file (weights dequantized to ``config.dtype``; tokenizer and chat template
    from its metadata; see :func:`engine.default_model.default_model_path` for
    the default one), or ``None`` for the built-in model: ``arch``
    (default :meth:`ModelArch.tiny`) with random weights from ``config.seed``.
    ``chat_template`` is the checkpoint's, or ``None`` when it has none.

    The KV cache lives in a kvstore :class:`GPUBlockPool`: ``pool`` shares an
    existing one (its layout must match the model and ``config.block_size``;
    ``config.num_gpu_blocks`` is then ignored), otherwise the engine creates
    one. ``block_manager_factory`` swaps the KV cache manager (a
    connector-backed one adds prefix caching); it receives the pool.
    ``connector`` is the usual way to get prefix caching across GPU, host and
    disk: the engine registers its pool with it and serves cached prefixes
    from any tier; ``preemption`` then chooses ``recompute`` or ``swap``
    (save full blocks to the host tier first). ``model_id`` names the weights
    in every block key; by default a checkpoint's is derived from its files
    (:func:`engine.model_id.checkpoint_identity`), never from its path.
    """

    def __init__(self, model: str | Path | None = None, *, config: EngineConfig | None = None,
                 arch: ModelArch | None = None, pool: GPUBlockPool | None = None,
                 block_manager_factory: Callable[[GPUBlockPool], BlockManager] | None = None,
                 connector: KVConnector | None = None, preemption: PreemptionMode = "recompute",
                 model_id: str | None = None) -> None:
        self.config = config or EngineConfig()
        device = self.config.torch_device()
        gguf = GGUFFile(model) if model is not None and is_gguf_path(model) else None
        if model is not None:
            if arch is not None:
                raise ValueError("pass either a checkpoint or an arch, not both")
            arch = checkpoint_config(model, gguf)
        cfg = arch or ModelArch.tiny()
        layout = engine_kv_layout(cfg, self.config, model, model_id)
        self.model = build_model(cfg, layout.torch_dtype, device)
        if gguf is not None:
            load_gguf_weights(self.model, gguf)
        elif model is not None:
            load_safetensors(self.model, model)
        else:
            init_random(self.model, self.config.seed)
        text = model_text(model, cfg, gguf)
        self.tokenizer: ByteTokenizer | HFTokenizer = text.tokenizer
        self.chat_template: ChatTemplate | None = text.chat_template
        self.eos_token_ids = cfg.eos_token_ids or (
            (ByteTokenizer.EOS,) if isinstance(self.tokenizer, ByteTokenizer) else ())
        if pool is not None and (pool.layout.block_shape != layout.block_shape or pool.layout.dtype != layout.dtype
                                 or pool.device != device):
            raise ValueError(f"the given pool ({pool.layout}, on {pool.device}) does not match the engine "
                             f"({layout}, on {device})")
        self.pool = pool if pool is not None else GPUBlockPool(layout, self.config.num_gpu_blocks, device)
        if connector is not None and block_manager_factory is not None:
            raise ValueError("pass either a connector or a block_manager_factory, not both")
        if connector is not None:
            windows = cfg.layer_windows  # blocks before every layer's window need no load
            window = max(windows) if windows and min(windows) > 0 else 0
            self.block_manager: BlockManager = ConnectorBlockManager(self.pool, connector, preemption, window)
        else:
            self.block_manager = (block_manager_factory or BlockManager)(self.pool)
        self.connector = connector
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self.runner = ModelRunner(self.model, self.pool, select_backend(self.config.backend, device))
        self.sampler = Sampler(self.config.seed)
        self._ids = itertools.count()

    @property
    def arch(self) -> ModelArch:
        """The model's configuration."""
        return self.model.config

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> SequenceState:
        """Queue one request (text or token ids); returns its sequence. Checks that it can ever fit.

        ``cache_salt`` isolates the request's cached prefix to one tenant; set
        it from trusted context (the tenant's identity), never from the prompt.
        """
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rid = request_id if request_id is not None else str(next(self._ids))
        seq = SequenceState(rid, ids, params, cache_salt=cache_salt)
        total = seq.num_prompt_tokens + params.max_tokens
        if total > self.arch.max_model_len:
            raise ValueError(f"request {rid!r}: {seq.num_prompt_tokens} prompt + {params.max_tokens} new tokens "
                             f"exceed the model's maximum length {self.arch.max_model_len}")
        blocks = -(-total // self.config.block_size)
        if blocks > self.pool.num_blocks:
            raise ValueError(f"request {rid!r} needs up to {blocks} KV blocks; the pool has {self.pool.num_blocks}")
        bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise ValueError(f"request {rid!r}: token ids {bad[:5]} are outside the vocabulary "
                             f"of {self.arch.vocab_size}")
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: SequenceState) -> None:
        """Stop ``seq`` before it finishes (its client went away): frees its blocks, finish reason ``abort``.

        Does nothing to a sequence that already finished.
        """
        if seq.is_finished:
            return
        self.scheduler.abort(seq)
        self.sampler.release(seq)
        seq.finish_reason = "abort"
        seq.metrics.finished_time = time.perf_counter()

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[SequenceState]:
        """Schedule, run the model once, sample; returns the sequences that finished in this step."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        now = time.perf_counter()
        for c in plan.chunks:
            if c.seq.metrics.first_scheduled_time is None:
                c.seq.metrics.first_scheduled_time = now
        seqs = [c.seq for c in plan.chunks]
        logits = self.runner.run(plan.chunks, before_layer=self.block_manager.before_layer(seqs))
        finished: list[SequenceState] = []
        for chunk, row in zip(plan.chunks, logits):
            seq = chunk.seq
            is_decode = chunk.num_tokens == 1 and bool(seq.output_token_ids) and chunk.completes
            if not is_decode:
                seq.metrics.num_prefill_tokens_computed += chunk.num_tokens
            seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.on_computed(seq)
            if not chunk.completes:
                continue  # a prefill chunk that does not reach the end samples nothing
            seq.output_token_ids.append(self.sampler.sample(seq, row))
            now = time.perf_counter()
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            reason, text = check_stop(seq, self.eos_token_ids, self.tokenizer.decode(seq.output_token_ids))
            seq.output_text = text
            if reason is not None:
                seq.finish_reason = reason
                seq.metrics.finished_time = now
                self.scheduler.finish(seq)
                self.sampler.release(seq)
                finished.append(seq)
        return finished

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order.

        ``prompts`` is one prompt or a list (text, or token-id lists); ``params``
        is one :class:`SamplingParams` for all or one per prompt; ``cache_salt``
        applies to every prompt of the call.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompt_list = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"{len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        seqs = [self.add_request(p, sp, cache_salt=cache_salt) for p, sp in zip(prompt_list, param_list)]
        while self.has_unfinished():
            self.step()
        return [RequestOutput.from_sequence(s) for s in seqs]
