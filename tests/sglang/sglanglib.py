"""Helpers for the SGLang tests: a CPU host KV pool, kvstore configs, the backend built the way SGLang builds it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import yaml
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from connectors.sglang.backend import KVStoreHiCacheStorage

PAGE = 4
"""Tokens per SGLang page (--page-size) and per kvstore block."""
MODEL = {"model_id": "sglang-test", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": PAGE,
         "dtype": "float16"}
EXTRA = {"backend_name": "kvstore", "module_path": "connectors.sglang.backend", "class_name": "KVStoreHiCacheStorage"}


def device_pool(layers: int = 2, heads: int = 2, head_dim: int = 8, page: int = PAGE) -> MHATokenToKVPool:
    """SGLang's own device KV pool, on the CPU."""
    return MHATokenToKVPool(64, page, torch.float16, heads, head_dim, layers, "cpu", False, start_layer=0,
                            end_layer=layers)


def host_pool(kv: MHATokenToKVPool, mem_layout: str = "layer_first", page: int = PAGE) -> MHATokenToKVPoolHost:
    """SGLang's host KV pool (what HiCache copies pages to and from storage), unpinned, on the CPU."""
    return MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, mem_layout,
                                pin_memory=False, device_capacity_tokens=kv.size, start_layer=kv.start_layer,
                                end_layer=kv.end_layer)


def write_kvstore_config(root: Path, name: str = "kvstore.yaml", **over: Any) -> Path:
    """An embedded kvstore config under ``root``: the test layout, 32 host blocks, LMDB in ``root/lmdb``."""
    data: dict[str, Any] = {
        "connector": "embedded",
        "tiers": ["host", "lmdb"],
        "model": dict(MODEL),
        "host": {"capacity": 32 * 2 * 2 * PAGE * 2 * 8 * 2},
        "disk": {"path": str(root / "lmdb"), "max_size": "16MiB", "sync": "interval"},
        "daemon": {"socket_path": str(root / "d.sock"), "hold_timeout_s": 2.0, "layouts": "model"},  # its disk at root/lmdb
        "metrics": {"port": 0},
        "logging": {"level": "INFO"},
    }
    for section, values in over.items():
        data.setdefault(section, {}).update(values) if isinstance(values, dict) else data.__setitem__(section, values)
    path = root / name
    path.write_text(yaml.safe_dump(data))
    return path


def storage_config(extra: dict[str, Any], tp_rank: int = 0, tp_size: int = 1,
                   model_name: str = "sglang-test") -> HiCacheStorageConfig:
    """What HiCacheController hands a storage backend (``_generate_storage_config``), for one MHA rank."""
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name=model_name, extra_config=extra)


def open_backend(config: Path, host: MHATokenToKVPoolHost, model_name: str = "sglang-test",
                 **extra: Any) -> KVStoreHiCacheStorage:
    """The backend as SGLang makes it for ``--hicache-storage-backend dynamic``: through its factory, then
    ``register_mem_pool_host`` (what ``HiCacheController.attach_storage_backend`` does)."""
    cfg = storage_config({**EXTRA, "kvstore_config": str(config), **extra}, model_name=model_name)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert isinstance(backend, KVStoreHiCacheStorage)
    backend.register_mem_pool_host(host)
    return backend


def page_hashes(n: int, seed: str = "p") -> list[str]:
    """``n`` SGLang-style page hashes (64 hex digits)."""
    return [hashlib.sha256(f"{seed}:{i}".encode()).hexdigest() for i in range(n)]


def fill_pages(host: MHATokenToKVPoolHost, n: int, seed: int = 0) -> torch.Tensor:
    """Allocate ``n`` host pages, write distinct random KV into them, return their host indices."""
    indices = host.alloc(n * host.page_size)
    assert indices is not None
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        page = torch.randn(host.get_dummy_flat_data_page().shape, generator=g).to(torch.float16)
        host.set_from_flat_data_page(int(indices[i * host.page_size]), page)
    return indices


def pages_at(host: MHATokenToKVPoolHost, indices: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the flat pages at ``indices`` (one per ``page_size`` indices)."""
    p = host.page_size
    return [host.get_data_page(int(indices[i * p]), flat=True).clone() for i in range(indices.numel() // p)]


def extra_json(config: Path, **more: Any) -> str:
    """The ``--hicache-storage-backend-extra-config`` value for ``config``."""
    return json.dumps({**EXTRA, "kvstore_config": str(config), **more})
