"""kvstore behind SGLang's HiCache L3 storage interface, embedded (host + LMDB in this process).

The backend is built by SGLang's own ``StorageBackendFactory`` (``dynamic``)
over SGLang's own CPU host KV pool, and called as ``HiCacheController`` calls
it: ``batch_exists`` with page hashes, ``batch_set_v1``/``batch_get_v1`` with
host indices (``"interface_v1": 1``), ``batch_set``/``batch_get`` with flat
pages (the default path), and the v2 pool-transfer calls.
"""

from __future__ import annotations

from sglang_stubs import require_sglang

require_sglang()

from pathlib import Path

import lmdb
import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

from sglanglib import (
    EXTRA, device_pool, fill_pages, host_pool, open_backend, page_hashes, pages_at, storage_config,
    write_kvstore_config,
)
from connectors.sglang.backend import KVStoreHiCacheStorage
from kvstore.config.loader import ConfigError


@pytest.fixture
def kv():  # type: ignore[no-untyped-def]
    return device_pool()


def test_pages_round_trip_by_host_index_and_as_flat_tensors(tmp_path: Path, kv) -> None:  # type: ignore[no-untyped-def]
    host = host_pool(kv)
    backend = open_backend(write_kvstore_config(tmp_path), host, interface_v1=1)
    keys = page_hashes(5)
    src = fill_pages(host, 5, seed=1)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys[:3], src[: 3 * 4]) == [True, True, True]
    # the default (non zero-copy) path: flat pages, as HiCacheController._generic_page_set builds them
    assert backend.batch_set(keys[3:], [host.get_data_page(int(src[i * 4])) for i in (3, 4)]) is True
    assert backend.batch_exists(keys) == 5 and backend.exists(keys[4])

    dst = host.alloc(5 * 4)
    assert backend.batch_get_v1(keys, dst) == [True] * 5
    for want, got in zip(pages_at(host, src), pages_at(host, dst)):
        assert torch.equal(want, got)
    flat = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert all(f is not None and torch.equal(f, w) for f, w in zip(flat, pages_at(host, src)))
    assert backend.get(page_hashes(1, seed="absent")[0]) is None
    backend.close()


def test_batch_exists_counts_consecutive_hits_and_a_gap_stops_the_count(tmp_path: Path, kv) -> None:  # type: ignore[no-untyped-def]
    host = host_pool(kv)
    backend = open_backend(write_kvstore_config(tmp_path), host)
    keys = page_hashes(5)
    src = fill_pages(host, 5)
    stored = [0, 1, 3, 4]  # page 2 missing
    assert backend.batch_set_v1([keys[i] for i in stored], torch.cat([src[i * 4 : i * 4 + 4] for i in stored])) == [True] * 4
    assert backend.batch_exists(keys) == 2
    assert backend.batch_exists(keys[3:]) == 2
    assert backend.batch_exists(keys[2:]) == 0
    assert backend.batch_exists([]) == 0
    result = backend.batch_exists_v2(keys)
    assert (result.kv_hit_pages, result.extra_pool_hit_pages, result.restorable_prefix_pages) == (2, {"kv": 2}, [1, 2])
    backend.close()


def test_v2_pool_transfers_move_kv_pages_and_refuse_other_pools(tmp_path: Path, kv) -> None:  # type: ignore[no-untyped-def]
    host = host_pool(kv)
    backend = open_backend(write_kvstore_config(tmp_path), host)
    backend.register_mem_host_pool_v2(host, PoolName.KV)
    keys = page_hashes(2)
    src, dst = fill_pages(host, 2), host.alloc(8)
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=src, keys=keys)]) == {"kv": [True, True]}
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=dst, keys=keys)]) == {"kv": [True, True]}
    assert all(torch.equal(a, b) for a, b in zip(pages_at(host, src), pages_at(host, dst)))
    with pytest.raises(ValueError, match="stores only the 'kv' pool, asked for \\['mamba'\\]"):
        backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys)])
    with pytest.raises(ValueError, match="stores only the 'kv' host pool, not 'swa'"):
        backend.register_mem_host_pool_v2(host, PoolName.SWA)
    backend.close()


def test_a_corrupt_page_on_disk_is_a_miss_never_served(tmp_path: Path, kv) -> None:  # type: ignore[no-untyped-def]
    host = host_pool(kv)
    config = write_kvstore_config(tmp_path)
    backend = open_backend(config, host, interface_v1=1)
    keys = page_hashes(3)
    src = fill_pages(host, 3, seed=7)
    assert backend.batch_set_v1(keys, src) == [True] * 3
    damaged = backend.keys_of(keys)[1]
    backend.close()  # written behind to LMDB and synced
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=2)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True, db=blocks) as txn:
        value = bytearray(txn.get(damaged))
        value[-3] ^= 0x40  # one bit of the page's bytes
        txn.put(damaged, bytes(value))
    env.close()

    backend = open_backend(config, host, interface_v1=1)  # a fresh host tier: every read comes from disk
    dst = host.alloc(12)
    sentinel = torch.full_like(host.get_data_page(int(dst[4])), 3.0)
    host.set_from_flat_data_page(int(dst[4]), sentinel)
    assert backend.batch_get_v1(keys, dst) == [True, False, True]
    got = pages_at(host, dst)
    assert torch.equal(got[0], pages_at(host, src)[0]) and torch.equal(got[2], pages_at(host, src)[2])
    assert torch.equal(got[1], sentinel)  # the damaged bytes never reached the host pool
    assert backend.store.stats().corrupt_dropped == 1
    assert backend.batch_exists(keys) == 1  # dropped: the prefix now ends before it
    backend.close()


def test_tenants_models_and_byte_orders_never_share_pages(tmp_path: Path, kv) -> None:  # type: ignore[no-untyped-def]
    host = host_pool(kv)
    config = write_kvstore_config(tmp_path)
    keys = page_hashes(2)
    src = fill_pages(host, 2, seed=3)
    a = open_backend(config, host, tenant="tenant-a")
    assert a.batch_set_v1(keys, src) == [True, True]
    a.close()

    b = open_backend(config, host, tenant="tenant-b")
    assert b.batch_exists(keys) == 0 and b.batch_get_v1(keys, host.alloc(8)) == [False, False]
    b.close()
    untenanted = open_backend(config, host)
    assert untenanted.batch_exists(keys) == 0
    untenanted.close()
    other_model = write_kvstore_config(tmp_path, "other.yaml", model={"model_id": "another-model"})
    m = open_backend(other_model, host, tenant="tenant-a")
    assert m.batch_exists(keys) == 0
    m.close()
    served = open_backend(config, host, model_name="another/served-model", tenant="tenant-a")
    assert served.batch_exists(keys) == 0  # same geometry and kvstore config, another model behind SGLang
    served.close()
    # page_first orders a page's elements differently: its pages are not these bytes
    pf = open_backend(config, host_pool(kv, "page_first"), tenant="tenant-a")
    assert pf.batch_exists(keys) == 0
    pf.close()
    # page_first_direct has layer_first's page order: the same pages, loaded into its own pool layout
    direct_host = host_pool(kv, "page_first_direct")
    direct = open_backend(config, direct_host, tenant="tenant-a")
    dst = direct_host.alloc(8)
    assert direct.batch_get_v1(keys, dst) == [True, True]
    assert all(torch.equal(x, y) for x, y in zip(pages_at(direct_host, dst), pages_at(host, src)))
    direct.close()
    again = open_backend(config, host, tenant="tenant-a")
    assert again.batch_exists(keys) == 2
    again.close()


def test_the_layout_must_describe_sglangs_pages(tmp_path: Path, kv) -> None:  # type: ignore[no-untyped-def]
    config = write_kvstore_config(tmp_path, model={"block_size": 8, "head_dim": 16})
    with pytest.raises(ValueError) as err:
        open_backend(config, host_pool(kv))
    msg = str(err.value)
    assert f"kvstore config {config} does not describe SGLang's host KV pages" in msg
    assert "model.head_dim is 16 but SGLang's host pool has 8" in msg
    assert "model.block_size is 8 but SGLang's host pool has 4" in msg


def test_bad_extra_config_and_models_fail_at_start_naming_what(tmp_path: Path) -> None:
    config = write_kvstore_config(tmp_path)
    with pytest.raises(ValueError, match="--hicache-storage-backend-extra-config: unknown key\\(s\\) \\['tenat'\\]"):
        KVStoreHiCacheStorage(storage_config({**EXTRA, "kvstore_config": str(config), "tenat": "x"}))
    with pytest.raises(ValueError, match="'tenant' must be a non-empty string, got 7"):
        KVStoreHiCacheStorage(storage_config({**EXTRA, "kvstore_config": str(config), "tenant": 7}))
    with pytest.raises(ConfigError, match="missing.yaml"):
        KVStoreHiCacheStorage(storage_config({**EXTRA, "kvstore_config": str(tmp_path / "missing.yaml")}))
    mla = storage_config({**EXTRA, "kvstore_config": str(config)})
    mla.is_mla_model = True
    with pytest.raises(ValueError, match="MLA models are not supported"):
        KVStoreHiCacheStorage(mla)
