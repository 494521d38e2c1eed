"""kvstore as SGLang HiCache's L3 storage backend (SGLang 0.5.23, ``hicache_storage.HiCacheStorage``).

SGLang loads it with no patch, through its ``dynamic`` backend
(``storage/backend_factory.py`` imports ``module_path`` and instantiates
``class_name`` with ``(storage_config, kwargs)``)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "connectors.sglang.backend", "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1, "kvstore_config": "/etc/kvstore/sglang.yaml", "tenant": "team-a"}'

What SGLang calls, and what it does here (every call is batched by pages)::

    batch_exists(page hashes)            -> consecutive pages stored, from the first
    batch_get_v1 / batch_set_v1          -> pages by host-pool index ("interface_v1": 1)
    batch_get / batch_set, get / set     -> pages as flat tensors (the default path)
    batch_exists_v2 / batch_get_v2 / _set_v2 -> the same for the KV pool's PoolTransfers

Keys: SGLang hands a storage backend its own page hashes (a SHA-256 chain
over all earlier tokens, seeded by the request's ``cache_salt``/``extra_key``),
never the tokens. Each is turned into a kvstore key by
:func:`connectors.engine_keys.engine_page_keys`: BLAKE2b over kvstore's root
key (layout fingerprint + tenant salt), a namespace (SGLang, the served
model's name, the flat page's element order, the TP/PP/CP shard) and the page
hash. So two models, two
dtypes, two tenants, two shards or two host byte orders never share a page.

Pages: one SGLang host page is one kvstore block (``--page-size`` ==
``model.block_size``, checked at start-up with every other field of the
layout, see :mod:`connectors.sglang.settings`). A page moves as its flat
bytes; a value that fails kvstore's checksum on disk is dropped and is a miss
(SGLang then loads only the pages before it, and recomputes the rest).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from connectors.engine_keys import engine_page_keys
from connectors.sglang.page_store import open_page_store
from connectors.sglang.settings import BackendSettings, HostPageGeometry
from kvstore.config import load_config
from kvstore.daemon.client.tier import DaemonTier
from kvstore.hashing import Salt

log = logging.getLogger(__name__)


class KVStoreHiCacheStorage(HiCacheStorage):
    """SGLang's HiCache L3 storage in kvstore's tiers (in this process, or a ``kvstore serve`` daemon)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        """Read the extra config, load the kvstore config and open the page store (connects to the daemon for
        ``connector: sidecar``). ``kwargs`` is what SGLang's factory passes a dynamic backend; unused.

        Raises ``ValueError`` naming the flag and key for a bad extra config or an MLA model,
        :class:`~kvstore.config.loader.ConfigError` for a bad kvstore config, and the page store's errors.
        """
        settings = BackendSettings.from_extra_config(storage_config.extra_config)
        if storage_config.is_mla_model:
            raise ValueError("the kvstore backend stores MHA pages (K and V per head); MLA models are not supported")
        self.storage_config = storage_config
        self.config_source = settings.kvstore_config or os.environ.get("KVSTORE_CONFIG", "<defaults>")
        self.cfg = load_config(settings.kvstore_config)
        self.layout = self.cfg.model.layout()
        c = storage_config
        self.store = open_page_store(self.cfg, client_name=f"sglang tp{c.tp_rank}/{c.tp_size} pid {os.getpid()}")
        assigned = self.store.salt if isinstance(self.store, DaemonTier) else None
        self.salt: Salt = assigned if assigned is not None else settings.tenant
        self.geometry: HostPageGeometry | None = None
        self.namespace: str | None = None

    # ------------------------------------------------------------ pools
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Check that the host pool's pages are this layout's blocks, and fix the key namespace. Changes no data.

        Raises ``ValueError`` naming each ``model`` field of the kvstore config that differs.
        """
        geometry = HostPageGeometry.of(mem_pool_host)
        geometry.check_against(self.layout, self.config_source)
        c = self.storage_config
        self.geometry = geometry
        # The served model's name as SGLang knows it (--model-path, or --served-model-name) joins the layout's
        # model_id: two models of one geometry behind one kvstore config still never share a page.
        self.namespace = (f"sglang|model={c.model_name or ''}|page={geometry.byte_order}|tp={c.tp_rank}/{c.tp_size}"
                          f"|pp={c.pp_rank}/{c.pp_size}|cp={c.attn_cp_rank}/{c.attn_cp_size}")
        super().register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Accept the KV pool (checked as by :meth:`register_mem_pool_host`); refuse any other pool by name.

        kvstore's tiers hold blocks of one fixed layout; Mamba, SWA or indexer
        pools have pages of other sizes, so a model that needs them cannot use this backend.
        """
        if str(host_pool_name) != PoolName.KV.value:
            raise ValueError(f"the kvstore backend stores only the {PoolName.KV.value!r} host pool, "
                             f"not {str(host_pool_name)!r} (hybrid models need a backend with variable-size pages)")
        if getattr(self, "mem_pool_host", None) is not host_pool:
            self.register_mem_pool_host(host_pool)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    # ------------------------------------------------------------- keys
    def keys_of(self, page_hashes: list[str]) -> list[bytes]:
        """kvstore keys of SGLang page hashes (see the module docstring). Changes nothing."""
        if self.namespace is None:
            raise RuntimeError("KVStoreHiCacheStorage: no host pool registered yet (register_mem_pool_host)")
        return engine_page_keys(self.layout, self.salt, self.namespace, page_hashes)

    # ---------------------------------------------------------- queries
    def exists(self, key: str) -> bool:
        """Whether the page is stored. Changes nothing."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many pages, consecutively from the first, are stored (a gap ends the count). Changes nothing."""
        return self.store.contains_prefix(self.keys_of(keys)) if keys else 0

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """:meth:`batch_exists` as a ``PoolTransferResult`` (only the KV pool exists here). Changes nothing."""
        self._only_kv(pool_transfers or [])
        hit = self.batch_exists(keys, extra_info)
        return PoolTransferResult(hit, {PoolName.KV.value: hit} if hit else {}, list(range(1, hit + 1)))

    # ------------------------------------------------- pages as tensors
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The page's flat tensor (written into ``target_location`` when given), or ``None`` on a miss."""
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each page into its target (a flat host page, ``get_dummy_flat_data_page()`` when not given); ``None`` = miss.

        A contiguous target is filled in place (no staging copy).
        """
        pool = self._pool()
        dests = list(target_locations) if target_locations is not None else [pool.get_dummy_flat_data_page() for _ in keys]
        staging = [d if d.is_contiguous() else d.contiguous() for d in dests]
        found = self.store.get(self.keys_of(keys), [self._bytes_of(s) for s in staging])
        for dest, stage, ok in zip(dests, staging, found):
            if ok and stage is not dest:
                dest.copy_(stage)
        return [d if ok else None for d, ok in zip(dests, found)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat page; ``True`` when it is stored afterwards."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages (``host_pool.get_data_page(i)``); ``True`` when every one is stored afterwards."""
        if values is None or len(values) != len(keys):
            raise ValueError(f"batch_set: {len(keys)} keys but {0 if values is None else len(values)} values")
        srcs = [self._bytes_of(v.contiguous()) for v in values]
        return all(self.store.put(self.keys_of(keys), srcs))

    # ------------------------------------------- pages by host index
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load pages straight into the host pool at ``host_indices`` (``page_size`` indices per key).

        ``result[i]`` says whether page ``i`` was loaded; a missed page's host slots are left untouched.
        """
        pool = self._pool()
        starts = self._page_starts(keys, host_indices)
        pages = self.batch_get(keys)
        for start, page in zip(starts, pages):
            if page is not None:
                pool.set_from_flat_data_page(start, page)
        return [p is not None for p in pages]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices``; ``result[i]`` says whether page ``i`` is stored."""
        pool = self._pool()
        srcs = [self._bytes_of(pool.get_data_page(start, flat=True).contiguous())
                for start in self._page_starts(keys, host_indices)]
        return self.store.put(self.keys_of(keys), srcs)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """:meth:`batch_get_v1` per transfer (KV pool only), keyed by pool name."""
        self._only_kv(transfers)
        return {str(t.name): self.batch_get_v1(t.keys or [], self._indices(t), extra_info) for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """:meth:`batch_set_v1` per transfer (KV pool only), keyed by pool name."""
        self._only_kv(transfers)
        return {str(t.name): self.batch_set_v1(t.keys or [], self._indices(t), extra_info) for t in transfers}

    # -------------------------------------------------------- lifecycle
    def clear(self) -> None:
        """Deletes nothing, on purpose: kvstore's blocks are content-addressed and may be shared with other
        engines and tenants; a server's ``flush_cache`` must not drop theirs. Remove data with kvstore's tools
        (or delete the LMDB directory) instead."""
        log.info("kvstore backend: clear() leaves kvstore's shared, content-addressed blocks in place")

    def close(self) -> None:
        """Flush and close the page store (the daemon, or the disk tier, keeps the data)."""
        self.store.close()

    # ---------------------------------------------------------- private
    def _pool(self) -> Any:
        pool = getattr(self, "mem_pool_host", None)
        if pool is None:
            raise RuntimeError("KVStoreHiCacheStorage: no host pool registered yet (register_mem_pool_host)")
        return pool

    def _page_starts(self, keys: list[str], host_indices: torch.Tensor) -> list[int]:
        """First host index of each key's page; ``ValueError`` unless there are ``page_size`` indices per key."""
        page = self._pool().page_size
        if host_indices.numel() != len(keys) * page:
            raise ValueError(f"{len(keys)} pages of {page} tokens need {len(keys) * page} host indices, "
                             f"got {host_indices.numel()}")
        return [int(host_indices[i * page].item()) for i in range(len(keys))]

    @staticmethod
    def _indices(transfer: PoolTransfer) -> torch.Tensor:
        if transfer.host_indices is None:
            raise ValueError(f"PoolTransfer {transfer.name}: no host_indices")
        return transfer.host_indices

    @staticmethod
    def _only_kv(transfers: list[PoolTransfer]) -> None:
        other = sorted({str(t.name) for t in transfers} - {PoolName.KV.value})
        if other:
            raise ValueError(f"the kvstore backend stores only the {PoolName.KV.value!r} pool, asked for {other}")

    @staticmethod
    def _bytes_of(page: torch.Tensor) -> torch.Tensor:
        """A contiguous page as the flat ``uint8`` view kvstore's tiers move (no copy)."""
        return page.reshape(-1).view(torch.uint8)
