"""``policy.write`` in the in-process stack (:class:`~kvstore.lower.local.LocalTier`, the daemon's storage code).

Under ``write_back`` (the default) a committed block stays in host only, *dirty*, until it must leave: host
and disk then hold distinct blocks, so the same RAM and disk hold more of the working set. A dirty block is
never dropped without a disk copy: it is written back when host room runs low, at a flush, and at close.
``write_through`` writes every committed block behind at once; ``write_through_selective`` once lookups
have hit it ``selective_hits`` times.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.config.schema import KVStoreConfig
from kvstore.daemon.server.dirty import HIGH_WATER_SHARE, LOW_WATER_SHARE
from kvstore.layout import KVLayout
from kvstore.lower.local import LocalTier

MODEL = {"model_id": "write-policy", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4,
         "dtype": "float16"}
LAYOUT = KVLayout(**MODEL)  # type: ignore[arg-type]
HOST_SLOTS = 16
SLAB_SLOT_BYTES = 4096
"""A slab slot: one 512-byte block plus its header, rounded up to 4 KiB (``slab.max_size``'s docstring)."""


def _block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (LAYOUT.bytes_per_block,), dtype=torch.uint8, generator=g)


def _keys(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in range(start, start + n)]


def _open(tmp_path: Path, write: str, **over: Any) -> LocalTier:
    data: dict[str, Any] = {"model": MODEL, "tiers": ["host", "lmdb"],
                            "host": {"capacity": HOST_SLOTS * LAYOUT.bytes_per_block},
                            "disk": {"path": str(tmp_path / "lmdb"), "max_size": "16MiB"},
                            "policy": {"write": write}}
    data.update(over)
    return LocalTier.from_config(KVStoreConfig.model_validate(data), LAYOUT)


def _put(tier: LocalTier, keys: list[bytes], step: int = 4) -> None:
    for at in range(0, len(keys), step):
        batch = keys[at : at + step]
        assert tier.put(batch, [_block(int.from_bytes(k, "big")) for k in batch]) == [True] * len(batch)


def _read_back(tier: LocalTier, keys: list[bytes]) -> None:
    """Every key found, bit for bit (read one by one: a read of more blocks than host holds is another test's)."""
    for key in keys:
        dest = torch.empty(LAYOUT.bytes_per_block, dtype=torch.uint8)
        assert tier.get([key], [dest]) == [True], f"block {int.from_bytes(key, 'big')} lost"
        assert torch.equal(dest, _block(int.from_bytes(key, "big")))


def _on_disk(tier: LocalTier, keys: list[bytes]) -> int:
    disk = tier.backend.disk
    assert disk is not None
    return sum(disk.contains(k) for k in keys)


def _drain(tier: LocalTier) -> None:
    assert tier.backend.writer is not None
    tier.backend.writer.drain()


def test_write_back_keeps_blocks_that_fit_off_disk_until_a_flush(tmp_path: Path) -> None:
    tier = _open(tmp_path, "write_back")
    try:
        keys = _keys(8)
        _put(tier, keys)
        _drain(tier)
        assert _on_disk(tier, keys) == 0
        assert tier.backend.stats()["dirty_blocks"] == 8
        tier.flush()
        assert _on_disk(tier, keys) == 8
        assert tier.backend.stats()["dirty_blocks"] == 0
        _read_back(tier, keys)
        tier.backend.host.check_integrity()
    finally:
        tier.close()


def test_write_back_put_of_more_than_host_holds_loses_nothing(tmp_path: Path) -> None:
    tier = _open(tmp_path, "write_back")
    try:
        keys = _keys(5 * HOST_SLOTS)
        _put(tier, keys)
        assert tier.backend.stats()["cleaned_ahead"] > 0  # written back ahead as host room ran low
        assert sum(tier.backend.host.contains(k) for k in keys) <= HOST_SLOTS  # the rest come from disk
        _read_back(tier, keys)
        tier.backend.host.check_integrity()
    finally:
        tier.close()


def test_write_back_writes_the_coldest_dirty_blocks_once_clean_room_falls_below_the_low_water_mark(
        tmp_path: Path) -> None:
    tier = _open(tmp_path, "write_back")  # LRU: the order blocks were put in is their eviction order
    try:
        low, high = HOST_SLOTS // LOW_WATER_SHARE, HOST_SLOTS // HIGH_WATER_SHARE
        keys = _keys(HOST_SLOTS)
        at = HOST_SLOTS - low + 1  # the put that leaves one slot fewer than the mark clean
        _put(tier, keys[: at - 1], step=1)
        _drain(tier)
        assert _on_disk(tier, keys) == 0
        _put(tier, keys[at - 1 : at], step=1)
        _drain(tier)
        written = [k for k in keys if tier.backend.disk is not None and tier.backend.disk.contains(k)]
        assert written == keys[: high - (HOST_SLOTS - at)]  # the coldest, up to the high-water mark of clean room
        assert tier.backend.stats()["cleaned_ahead"] == len(written)
    finally:
        tier.close()


def test_write_back_blocks_survive_a_close_and_reopen(tmp_path: Path) -> None:
    keys = _keys(HOST_SLOTS // 2)
    tier = _open(tmp_path, "write_back")
    try:
        _put(tier, keys)
        assert _on_disk(tier, keys) == 0
    finally:
        tier.close()  # no flush: close writes the dirty blocks down
    tier = _open(tmp_path, "write_back")
    try:
        assert _on_disk(tier, keys) == len(keys)
        _read_back(tier, keys)
    finally:
        tier.close()


def test_write_through_writes_at_commit_without_a_flush(tmp_path: Path) -> None:
    tier = _open(tmp_path, "write_through")
    try:
        keys = _keys(8)
        _put(tier, keys)
        _drain(tier)
        assert _on_disk(tier, keys) == 8
        assert tier.backend.stats()["dirty_blocks"] == 0
    finally:
        tier.close()


def test_write_through_selective_writes_a_block_once_read_selective_hits_times(tmp_path: Path) -> None:
    tier = _open(tmp_path, "write_through_selective", policy={"write": "write_through_selective", "selective_hits": 2})
    try:
        hot, cold = _keys(4), _keys(4, start=100)
        _put(tier, hot + cold)
        _read_back(tier, hot)
        _drain(tier)
        assert _on_disk(tier, hot + cold) == 0  # one hit each: not due yet
        _read_back(tier, hot)
        _drain(tier)
        assert _on_disk(tier, hot) == 4 and _on_disk(tier, cold) == 0
        assert tier.backend.stats()["written_on_hits"] == 4
    finally:
        tier.close()


def test_sync_always_writes_at_commit_whatever_the_policy(tmp_path: Path) -> None:
    tier = _open(tmp_path, "write_back", disk={"path": str(tmp_path / "lmdb"), "max_size": "16MiB", "sync": "always"})
    try:
        keys = _keys(4)
        _put(tier, keys)
        assert _on_disk(tier, keys) == 4  # a put returns only when its blocks are on disk
        assert tier.backend.dirty is None
    finally:
        tier.close()


def _findable(tmp_path: Path, write: str, host: int, disk: int) -> int:
    tier = _open(tmp_path / write, write, tiers=["host", "slab"],
                 slab={"path": str(tmp_path / write / "slab"), "max_size": disk * SLAB_SLOT_BYTES})
    try:
        assert tier.backend.host.num_slots == host
        keys = _keys(host + disk)
        _put(tier, keys)
        _drain(tier)
        return sum(tier.get([k], [torch.empty(LAYOUT.bytes_per_block, dtype=torch.uint8)])[0] for k in keys)
    finally:
        tier.close()


def test_write_back_tiers_hold_more_distinct_blocks_than_write_through(tmp_path: Path) -> None:
    disk = 2 * HOST_SLOTS
    through = _findable(tmp_path, "write_through", HOST_SLOTS, disk)
    back = _findable(tmp_path, "write_back", HOST_SLOTS, disk)
    assert through == disk  # inclusive: host holds copies of disk blocks
    # distinct: all but the host's clean room written back ahead (HIGH_WATER_SHARE) are extra capacity
    assert back >= disk + HOST_SLOTS - HOST_SLOTS // HIGH_WATER_SHARE
    assert back > through


@pytest.mark.parametrize("write", ["write_back", "write_through"])
def test_without_a_disk_tier_nothing_changes(tmp_path: Path, write: str) -> None:
    tier = _open(tmp_path, write, tiers=["host"])
    try:
        keys = _keys(HOST_SLOTS)
        _put(tier, keys)
        _read_back(tier, keys)
        assert tier.backend.dirty is None and tier.backend.stats()["dirty_blocks"] == 0
    finally:
        tier.close()
