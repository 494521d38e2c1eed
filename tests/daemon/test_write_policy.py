"""The daemon honours ``policy.write``: a real ``kvstore serve`` and its clients.

``write_back`` (the default): a committed block is held in the shared host tier only, dirty, until host
room runs low (written back ahead, coldest first), a FLUSH, or a graceful stop; so host and disk hold
distinct blocks. ``write_through``: written behind at commit, on disk once the writer drains, with no
FLUSH. ``write_through_selective``: written once clients have read it ``selective_hits`` times.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from daemonlib import (
    LAYOUT, Daemon, block_for, cleanup, empty_blocks, keys_for, short_tmpdir, start_daemon, write_config,
)
from kvstore.daemon.server.dirty import HIGH_WATER_SHARE
from kvstore.daemon.client.tier import DaemonTier

HOST_SLOTS = 64  # daemonlib's config


def _disk_blocks(tier: DaemonTier) -> int:
    stats: Any = tier.client.stats()
    return int(stats["disk"]["num_blocks"])


def _put(tier: DaemonTier, keys: list[bytes], step: int = 8) -> None:
    for at in range(0, len(keys), step):
        batch = keys[at : at + step]
        assert tier.put(batch, [block_for(k) for k in batch]) == [True] * len(batch)


def _read_back(tier: DaemonTier, keys: list[bytes], step: int = 8) -> None:
    for at in range(0, len(keys), step):
        batch = keys[at : at + step]
        dests = empty_blocks(len(batch))
        assert tier.get(batch, dests) == [True] * len(batch)
        for key, dest in zip(batch, dests):
            assert torch.equal(dest, block_for(key)), f"block {key[:8].hex()} served with wrong bytes"


def _until(what: str, check: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _metric(daemon: Daemon, name: str) -> float:
    assert daemon.metrics_url is not None
    with urllib.request.urlopen(f"{daemon.metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or
               line.startswith(name + "{"))


def test_write_back_writes_at_flush_and_when_host_is_full_and_loses_nothing() -> None:
    root = short_tmpdir()
    daemon = None
    try:
        daemon = start_daemon(write_config(root, policy={"write": "write_back"}))
        tier = daemon.tier()
        fit = keys_for(16, seed=1)
        _put(tier, fit)
        time.sleep(0.3)  # were they queued, the writer would have written them by now
        assert _disk_blocks(tier) == 0
        assert _metric(daemon, "kvstore_dirty_blocks") == 16
        tier.client.flush()
        assert _disk_blocks(tier) == 16
        assert _metric(daemon, "kvstore_dirty_blocks") == 0

        more = keys_for(4 * HOST_SLOTS, seed=2)  # four times what host holds
        _put(tier, more)
        _read_back(tier, fit + more)  # the evicted ones from disk, bit for bit
        assert _metric(daemon, "kvstore_cleaned_ahead_total") > 0
        tier.close()
    finally:
        cleanup(daemon, root)


def test_write_back_blocks_are_found_after_a_graceful_restart() -> None:
    root = short_tmpdir()
    daemon = None
    try:
        config = write_config(root)  # policy.write unset: write_back, the default
        daemon = start_daemon(config)
        tier = daemon.tier()
        keys = keys_for(24, seed=3)
        _put(tier, keys)
        assert _disk_blocks(tier) == 0
        tier.close()
        assert daemon.stop() == 0  # SIGTERM: the stop writes dirty blocks down
        daemon = start_daemon(config)
        tier = daemon.tier()
        assert _disk_blocks(tier) == len(keys)
        _read_back(tier, keys)
        tier.close()
    finally:
        cleanup(daemon, root)


def test_write_through_blocks_reach_disk_without_a_flush() -> None:
    root = short_tmpdir()
    daemon = None
    try:
        daemon = start_daemon(write_config(root, policy={"write": "write_through"}))
        tier = daemon.tier()
        keys = keys_for(16, seed=4)
        _put(tier, keys)
        _until("the writer wrote every block", lambda: _disk_blocks(tier) == 16)
        tier.close()
    finally:
        cleanup(daemon, root)


def test_write_through_selective_writes_a_block_read_selective_hits_times() -> None:
    root = short_tmpdir()
    daemon = None
    try:
        daemon = start_daemon(write_config(root, policy={"write": "write_through_selective", "selective_hits": 2}))
        tier = daemon.tier()
        hot, cold = keys_for(4, seed=5), keys_for(4, seed=6)
        _put(tier, hot + cold)
        _read_back(tier, hot)
        time.sleep(0.3)
        assert _disk_blocks(tier) == 0  # one read each: not due yet
        _read_back(tier, hot)
        _until("the hot blocks reached disk", lambda: _disk_blocks(tier) == 4)
        time.sleep(0.3)
        assert _disk_blocks(tier) == 4  # the cold ones stay dirty, in host only
        tier.close()
    finally:
        cleanup(daemon, root)


def _findable_through_daemon(root: Path, write: str, disk_blocks: int) -> int:
    assert LAYOUT.bytes_per_block + 48 <= 4096  # a slab slot (a block and its header, in 4 KiB) holds one block
    slab = {"path": str(root / write / "slab"), "max_size": disk_blocks * 4096}
    daemon = start_daemon(write_config(root, tiers=["host", "slab"], slab=slab, policy={"write": write},
                                       daemon={"socket_path": str(root / f"{write[:9]}.sock")}))
    try:
        tier = daemon.tier()
        keys = keys_for(HOST_SLOTS + disk_blocks, seed=7)
        _put(tier, keys)
        time.sleep(0.5)
        found = 0
        for key in keys:
            found += tier.get([key], empty_blocks(1))[0]
        tier.close()
        return found
    finally:
        daemon.stop()


def test_write_back_holds_more_distinct_blocks_than_write_through() -> None:
    root = short_tmpdir()
    try:
        disk = 2 * HOST_SLOTS
        through = _findable_through_daemon(root, "write_through", disk)
        back = _findable_through_daemon(root, "write_back", disk)
        assert through == disk  # inclusive: host holds copies of disk blocks
        # distinct: all of host is extra capacity but its clean room, written back ahead (HIGH_WATER_SHARE)
        assert back >= disk + HOST_SLOTS - HOST_SLOTS // HIGH_WATER_SHARE
    finally:
        cleanup(None, root)

