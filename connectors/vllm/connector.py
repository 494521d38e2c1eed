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
the request's ``cache_salt`` (or the daemon's tenant salt). Supported: full
attention, MLA, sliding windows, hybrids of them under vLLM's hybrid allocator
(several KV cache groups: ``SupportsHMA``; each layer's slice goes to its own
group's block), tensor parallelism (each rank stores its own shard under its
own keys, :mod:`connectors.vllm.shards`). Refused, naming why: layers whose
cache is not per-token K/V (Mamba, linear attention), pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults, SupportsHMA,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from connectors.engine_keys import engine_layout
from connectors.engine_store import EngineBlockStore, load_store_config
from connectors.vllm.connector_meta import KVStoreConnectorMetadata
from connectors.vllm.connector_scheduler import KVStoreConnectorScheduler
from connectors.vllm.connector_worker import KVStoreConnectorWorker
from connectors.vllm.identity import engine_kv_format, model_identity
from connectors.vllm.shards import Shard, all_shards
from connectors.vllm.stats import (
    HealthReport, KVStoreConnectorStats, KVStorePromMetrics, worker_clock, worker_forward,
)
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics, KVConnectorStats, PromMetric, PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


_STORABLE = ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec")
"""KV cache specs whose blocks hold attention K/V of ``block_size`` tokens at their positions (MLA and fp8
variants included): what a kvstore block can carry. Mamba / linear-attention state and ring buffers are not."""


def _storable(spec: object) -> bool:
    return isinstance(spec, AttentionSpec) and any(c.__name__ in _STORABLE for c in type(spec).__mro__)


@dataclass(frozen=True)
class BlockLayout:
    """How one kvstore block carries one vLLM block position of every attention layer.

    ``layers`` in model order (the layers' index in their names), so the block's bytes do not depend on how
    vLLM grouped them; ``groups[i]``: the KV cache group of ``layers[i]`` (its block table: under vLLM's
    hybrid allocator each group has its own); ``page``: bytes per block per layer, the same for every group."""

    layout: KVLayout
    layers: tuple[str, ...]
    groups: tuple[int, ...]
    page: int


def _layer_index(name: str) -> tuple[int, str]:
    digits = [int(part) for part in name.split(".") if part.isdigit()]
    return (digits[0] if digits else -1, name)


def block_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_id: str | None = None) -> BlockLayout:
    """The :class:`BlockLayout` of one vLLM block of every layer of every KV cache group.

    The layout's model id names the weights and the KV format (:mod:`connectors.vllm.identity`;
    ``model_id`` overrides the weights' part); its ``extra`` names each layer's kind in model order (one
    kind: as before hybrid support, so stored blocks stay valid). Under tensor parallelism the layout is one
    rank's shard (every rank's is the same) and names the group's size. Raises ``ValueError`` naming what
    cannot be stored: a group that is not attention K/V (Mamba or linear-attention state, ring buffers),
    groups with different page sizes, pipeline parallelism.
    """
    groups = kv_cache_config.kv_cache_groups
    model = vllm_config.model_config.model
    refused = {name: type(g.kv_cache_spec).__name__ for g in groups if not _storable(g.kv_cache_spec)
               for name in g.layer_names}
    if refused:
        kinds = sorted(set(refused.values()))
        raise ValueError(f"KVStoreConnector stores attention K/V blocks only; {model} has layers whose cache is "
                         f"{' and '.join(kinds)} ({len(refused)} layers, e.g. {', '.join(list(refused)[:3])}): "
                         f"state that is not per-token K/V (Mamba / linear attention) cannot be loaded as a prefix "
                         f"here. Serve this model without --kv-transfer-config")
    p = vllm_config.parallel_config
    if p.pipeline_parallel_size != 1:
        raise ValueError(f"KVStoreConnector does not support pipeline parallelism (pipeline_parallel_size="
                         f"{p.pipeline_parallel_size}): each stage holds other layers; run tensor parallelism only")
    pages = {g.kv_cache_spec.page_size_bytes for g in groups}
    if len(pages) != 1:
        raise ValueError(f"KVStoreConnector needs one page size across KV cache groups; {model} has {sorted(pages)}")
    page = pages.pop()
    owner = {name: gi for gi, g in enumerate(groups) for name in g.layer_names}
    spec_of = {name: g.kv_cache_spec for g in groups for name in g.layer_names}
    layers = sorted(owner, key=_layer_index)
    kinds = [type(spec_of[n]).__name__ for n in layers]
    kind = kinds[0] if len(set(kinds)) == 1 else ",".join(f"{k}*{len(list(run))}" for k, run in groupby(kinds))
    spec = groups[0].kv_cache_spec
    mc = vllm_config.model_config
    tp = f"|tp={p.tensor_parallel_size}" if p.tensor_parallel_size > 1 else ""
    layout = engine_layout("vllm-blocks", model_identity(mc.model, mc.revision, model_id), str(spec.dtype),
                           spec.block_size, page * len(layers),
                           f"layers={len(layers)}|{kind}|{engine_kv_format(vllm_config, spec)}{tp}")
    return BlockLayout(layout, tuple(layers), tuple(owner[n] for n in layers), page)


def _tp_rank(size: int) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    if size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
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
        blocks = block_layout(vllm_config, kv_cache_config, extra.get("model_id"))
        layout = blocks.layout
        store = EngineBlockStore.open(cfg, layout, client_name=f"vllm {role.name.lower()}")
        self.connector_scheduler: KVStoreConnectorScheduler | None = None
        self.connector_worker: KVStoreConnectorWorker | None = None
        tp = vllm_config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            tc = self._kv_transfer_config
            self.connector_scheduler = KVStoreConnectorScheduler(store, layout, loads=tc.is_kv_consumer,
                                                                 saves=tc.is_kv_producer, shards=all_shards(tp),
                                                                 groups=len(kv_cache_config.kv_cache_groups))
            self._health = HealthReport("scheduler", store, cost=self.connector_scheduler.cost,
                                        steps=self.connector_scheduler.load_steps)
        else:
            rank = _tp_rank(tp)
            self.connector_worker = KVStoreConnectorWorker(store, layout, blocks.layers, kv_cache_config.num_blocks,
                                                           blocks.page, Shard(rank, tp), blocks.groups)
            self._health = HealthReport(f"worker {rank}", store, self.connector_worker.save_queue,
                                        forward=self.connector_worker.forward_time,
                                        steps=self.connector_worker.load_steps)

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
        scheduler = self._scheduler()
        stats = getattr(connector_output, "kv_connector_stats", None)
        scheduler.step_done(worker_clock(stats), worker_forward(stats))
        scheduler.on_load_errors(set(connector_output.invalid_block_ids or ()),
                                 set(getattr(connector_output, "failed_recving", None) or ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
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
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None and isinstance(connector_metadata, KVStoreConnectorMetadata):
            self.connector_worker.forward_begins(connector_metadata)

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

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads of a hybrid model's requests (several KV cache groups) are vLLM's asynchronous kind: each
        ends here, a failed one in ``failed_recving`` too (vLLM then recomputes the request)."""
        done, failed = self._worker().take_finished_loads()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    # ---------------------------------------------------------------- metrics
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What changed since the last call: breakers, misses by operation and reason (vLLM's ``/metrics``)."""
        return self._health.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=data) if data is not None else KVStoreConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.close()
            self.connector_scheduler.store.close()
