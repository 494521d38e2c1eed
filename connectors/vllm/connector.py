"""kvstore's full vLLM connector (``KVConnectorBase_V1``), what LMCache's connector is for LMCache.

vLLM loads from and saves to kvstore directly, block by block: no vLLM CPU
tier in between. Scheduler side: :mod:`connectors.vllm.connector_scheduler`;
worker side: :mod:`connectors.vllm.connector_worker`. Both sides talk to the
same ``kvstore serve`` daemon (the scheduler and the workers are different
processes, and the daemon is the store they share), so the kvstore config
must say ``connector: sidecar``. Configured with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "connectors.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"kvstore_config": "/path/kvstore.yaml"}}'

One kvstore block is one vLLM block of every layer (see
:func:`block_layout`); keys come from the token ids with kvstore's rules and
the request's ``cache_salt`` (or the daemon's tenant salt). Supported: one
KV cache group (full attention or MLA), tensor parallelism (each rank stores
its own shard under its own keys, :mod:`connectors.vllm.shards`); pipeline
parallelism is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from connectors.engine_keys import engine_layout
from connectors.engine_store import EngineBlockStore, load_store_config
from connectors.vllm.connector_meta import KVStoreConnectorMetadata
from connectors.vllm.connector_scheduler import KVStoreConnectorScheduler
from connectors.vllm.connector_worker import KVStoreConnectorWorker
from connectors.vllm.identity import engine_kv_format, model_identity
from connectors.vllm.shards import Shard, all_shards
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def block_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 model_id: str | None = None) -> tuple[KVLayout, list[str], int]:
    """``(layout, layer names, bytes per block per layer)`` of one vLLM block of every layer.

    The layout's model id names the weights and the KV format
    (:mod:`connectors.vllm.identity`; ``model_id`` overrides the weights' part).
    Under tensor parallelism the layout is one rank's shard (every rank's is the same) and names the group's
    size. Raises ``ValueError`` naming what is unsupported: several KV cache groups, a non-attention group,
    pipeline parallelism.
    """
    groups = kv_cache_config.kv_cache_groups
    model = vllm_config.model_config.model
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
        raise ValueError(f"KVStoreConnector supports one attention KV cache group; {model} has "
                         f"{[type(g.kv_cache_spec).__name__ for g in groups]}")
    p = vllm_config.parallel_config
    if p.pipeline_parallel_size != 1:
        raise ValueError(f"KVStoreConnector does not support pipeline parallelism (pipeline_parallel_size="
                         f"{p.pipeline_parallel_size}): each stage holds other layers; run tensor parallelism only")
    spec = groups[0].kv_cache_spec
    layers = list(groups[0].layer_names)
    page = spec.page_size_bytes
    mc = vllm_config.model_config
    tp = f"|tp={p.tensor_parallel_size}" if p.tensor_parallel_size > 1 else ""
    layout = engine_layout("vllm-blocks", model_identity(mc.model, mc.revision, model_id), str(spec.dtype),
                           spec.block_size, page * len(layers),
                           f"layers={len(layers)}|{type(spec).__name__}|{engine_kv_format(vllm_config, spec)}{tp}")
    return layout, layers, page


def _tp_rank(size: int) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    if size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM KV connector over kvstore (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - {"kvstore_config", "model_id"})
        if unknown:
            raise ValueError(f"KVStoreConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                             f"it takes 'kvstore_config' and 'model_id'")
        cfg = load_store_config(extra.get("kvstore_config"))
        if cfg.connector != "sidecar":
            raise ValueError(f"KVStoreConnector needs a kvstore config with 'connector: sidecar' (its scheduler and "
                             f"workers share the daemon's store); {extra.get('kvstore_config') or 'the default config'} "
                             f"says {cfg.connector!r}. For an embedded store use KVStoreOffloadingConnector")
        layout, layers, page = block_layout(vllm_config, kv_cache_config, extra.get("model_id"))
        store = EngineBlockStore.open(cfg, layout, client_name=f"vllm {role.name.lower()}")
        self.connector_scheduler: KVStoreConnectorScheduler | None = None
        self.connector_worker: KVStoreConnectorWorker | None = None
        tp = vllm_config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            tc = self._kv_transfer_config
            self.connector_scheduler = KVStoreConnectorScheduler(store, layout, loads=tc.is_kv_consumer,
                                                                 saves=tc.is_kv_producer, shards=all_shards(tp))
        else:
            self.connector_worker = KVStoreConnectorWorker(store, layout, layers, kv_cache_config.num_blocks, page,
                                                           Shard(_tp_rank(tp), tp))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that did not happen is a later miss, nothing waits for it

    def _scheduler(self) -> KVStoreConnectorScheduler:
        if self.connector_scheduler is None:
            raise RuntimeError("KVStoreConnector: a scheduler-side method called on a worker connector")
        return self.connector_scheduler

    def _worker(self) -> KVStoreConnectorWorker:
        if self.connector_worker is None:
            raise RuntimeError("KVStoreConnector: a worker-side method called on the scheduler connector")
        return self.connector_worker

    def _meta(self) -> KVStoreConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        return meta

    # ------------------------------------------------------------ scheduler
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.connector_scheduler is not None:
            self.connector_scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().on_load_errors(set(connector_output.invalid_block_ids or ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    def reset_cache(self) -> bool:
        """From now on this engine loads no block stored before the call (its own or another engine's).

        vLLM calls it for ``reset_prefix_cache(reset_connector=True)``, after
        in-place weight updates among other reasons, when stored KV no longer
        matches the weights. The daemon's blocks are shared with other engines,
        for which they stay right, so they are not deleted: this engine's keys
        take a fresh random epoch instead (:meth:`KVStoreConnectorScheduler.reset`).
        A new process starts from the checkpoint's weights again and shares the
        blocks stored without an epoch.
        """
        self._scheduler().reset()
        return True

    # --------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self._worker().save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.store.close()
