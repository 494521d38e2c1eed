"""The daemon under ``policy.placement: adaptive`` (the default): its host and disk tiers evict through one duel
referee, and blocks the host evicts still come back from disk bit-identical."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from daemonlib import block_for, cleanup, empty_blocks, keys_for, short_tmpdir, start_daemon, write_config

from kvstore.config import load_config
from kvstore.daemon.server.daemon import DaemonServer
from kvstore.policy.duel import DuelIndex

SHARED = {"policy": {"placement": "adaptive"}}


def test_the_daemon_builds_its_host_and_disk_tiers_on_one_referee() -> None:
    root = short_tmpdir()
    server = DaemonServer(load_config(write_config(root, metrics={"enabled": False}, **SHARED)))

    async def run() -> None:
        await server.start()
        try:
            assert server.backend is not None and server.backend.disk is not None
            disk = server.backend.disk
            host_order, disk_order = server.backend.host._order, getattr(disk, "inner", disk)._lru
            assert isinstance(host_order, DuelIndex) and isinstance(disk_order, DuelIndex)
            assert host_order.referee is disk_order.referee and (host_order.level, disk_order.level) == (0, 1)
        finally:
            await server.stop()

    try:
        asyncio.run(run())
    finally:
        cleanup(None, root)


def test_blocks_the_host_evicts_come_back_from_disk_under_the_shared_duel() -> None:
    root: Path = short_tmpdir()
    daemon = None
    try:
        daemon = start_daemon(write_config(root, **SHARED))
        tier = daemon.tier(client_name="shared-duel")
        keys = keys_for(150, seed=21)  # 64 host slots: most leave the host tier
        assert all(tier.put(keys, [block_for(k) for k in keys]))
        tier.flush()
        before = tier.client.stats()
        assert before["host"]["evictions"] > 0
        dests = empty_blocks(150)
        assert tier.get(keys, dests) == [True] * 150
        assert all(torch.equal(d, block_for(k)) for k, d in zip(keys, dests))
        assert tier.client.stats()["counters"]["disk_hits"] > before["counters"]["disk_hits"]
        tier.close()
    finally:
        cleanup(daemon, root)
