"""A put larger than the host tier is written through to disk, not refused.

SGLang backs up 128 pages per batch; under a real SGLang engine a 64 MiB host tier held 91 of them and
the in-process store answered the other 37 "not stored": SGLang kept no lower copy of that prefix. The
in-process stack (the engine adapters' ``connector: embedded``) now writes what the host tier has no
room for straight to its disk tier, so every block of the batch is stored and reads back bit-identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from connectors.engine_store import EngineBlockStore
from connectors.sglang.page_store import open_page_store
from kvstore.config.schema import KVStoreConfig
from kvstore.layout import KVLayout
from kvstore.lower.local import LocalTier
from kvstore.tiers.base import Tier

MODEL = {"model_id": "write-through", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4,
         "dtype": "float16"}
LAYOUT = KVLayout(**MODEL)  # type: ignore[arg-type]
HOST_SLOTS = 8
BATCH = 20


def _block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (LAYOUT.bytes_per_block,), dtype=torch.uint8, generator=g)


def _config(tmp_path: Path) -> KVStoreConfig:
    return KVStoreConfig.model_validate({
        "model": MODEL, "tiers": ["host", "lmdb"], "host": {"capacity": HOST_SLOTS * LAYOUT.bytes_per_block},
        "disk": {"path": str(tmp_path / "lmdb"), "max_size": "16MiB"}})


def _open(cfg: KVStoreConfig, opener: str) -> Tier:
    if opener == "sglang":
        return open_page_store(cfg, "write-through")
    store = EngineBlockStore.open(cfg, LAYOUT)
    return store.tiers[0]


@pytest.mark.parametrize("opener", ["sglang", "engine_store"])
def test_a_batch_larger_than_the_host_tier_is_stored_and_reads_back(tmp_path: Path, opener: str) -> None:
    tier = _open(_config(tmp_path), opener)
    try:
        assert isinstance(tier, LocalTier) and tier.backend.host.num_slots == HOST_SLOTS
        keys = [i.to_bytes(32, "big") for i in range(BATCH)]
        blocks = [_block(i) for i in range(BATCH)]
        assert tier.put(keys, blocks) == [True] * BATCH
        assert tier.backend.counters.written_through == BATCH - HOST_SLOTS  # the slots this put itself filled
        assert tier.contains_prefix(keys) == BATCH
        dests = [torch.empty(LAYOUT.bytes_per_block, dtype=torch.uint8) for _ in keys]
        assert tier.get(keys, dests) == [True] * BATCH
        assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
        tier.flush()
    finally:
        tier.close()
    reopened = _open(_config(tmp_path), "sglang")  # on disk, all of them: the written-through ones too
    try:
        dests = [torch.empty(LAYOUT.bytes_per_block, dtype=torch.uint8) for _ in keys]
        assert reopened.get(keys, dests) == [True] * BATCH
        assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
    finally:
        reopened.close()


def test_without_a_disk_tier_what_does_not_fit_is_refused(tmp_path: Path) -> None:
    cfg = KVStoreConfig.model_validate({"model": MODEL, "tiers": ["host"],
                                        "host": {"capacity": HOST_SLOTS * LAYOUT.bytes_per_block}})
    tier = open_page_store(cfg, "write-through")
    try:
        keys = [i.to_bytes(32, "big") for i in range(BATCH)]
        stored = tier.put(keys, [_block(i) for i in range(BATCH)])
        assert sum(stored) == HOST_SLOTS  # nowhere to write the rest: answered "not stored", never a lie
    finally:
        tier.close()
