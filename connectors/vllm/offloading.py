"""vLLM's OffloadingConnector, handing each request's token ids to kvstore secondary tiers.

vLLM's secondary-tier API names chunks by vLLM's block hashes only; kvstore
keys them by token ids (:mod:`connectors.vllm.tiering`). This subclass
changes nothing else: before vLLM's scheduler announces a request to its
tiers (``on_new_request``, and ``request_finished`` for a request it never
announced), it offers the request to every
:class:`~connectors.vllm.tiering.KVStoreSecondaryTier`. Use it in place of
``OffloadingConnector``::

    "kv_connector": "KVStoreOffloadingConnector",
    "kv_connector_module_path": "connectors.vllm.offloading",
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from connectors.vllm.tiering import KVStoreSecondaryTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KVStoreOffloadingConnector(OffloadingConnector):
    """``OffloadingConnector`` that tells its kvstore tiers the token ids of every request."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.kvstore_tiers: list[KVStoreSecondaryTier] = []
        """The scheduler's kvstore secondary tiers (none on a worker, which has no tiers)."""
        if role == KVConnectorRole.SCHEDULER:
            tiers = getattr(self.scheduler.manager, "secondary_tiers", [])
            self.kvstore_tiers = [t for t in tiers if isinstance(t, KVStoreSecondaryTier)]

    def on_new_request(self, request: Request) -> None:
        self._offer(request)
        super().on_new_request(request)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._offer(request)
        try:
            return super().request_finished(request, block_ids)
        finally:
            self._forget(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self._offer(request)
        try:
            return super().request_finished_all_groups(request, block_ids)
        finally:
            self._forget(request)

    def _offer(self, request: Request) -> None:
        for tier in self.kvstore_tiers:
            tier.prompts.offer(request)

    def _forget(self, request: Request) -> None:
        """Drop an offer the tiers did not take (vLLM had announced the request already)."""
        for tier in self.kvstore_tiers:
            tier.prompts.take(request.request_id)
