"""Every path that stores blocks below the GPU builds the tiers one config names, with its placement policy.

The embedded store, the daemon (and so a sidecar engine store, whose blocks land in it), the engine
adapters' embedded store and the SGLang backend's in-process store are each built from one config that
names a non-default placement (``s3fifo``), a disk tier, a remote tier and non-default write policies;
each must run S3-FIFO on its host and disk tiers, LMDB as its disk, the remote tier with ``remote.write``
as configured. Before the tiers were built in one place (``kvstore/lower/build.py``), the engine store
and the SGLang store evicted LRU whatever ``policy.placement`` said and the engine store had no remote
tier at all.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from connectors.engine_store import EngineBlockStore
from connectors.sglang.page_store import open_page_store
from kvstore.config import load_config
from kvstore.config.schema import KVStoreConfig
from kvstore.daemon.server.backend import DaemonBackend
from kvstore.daemon.server.daemon import DaemonServer
from kvstore.daemon.client.tier import DaemonTier
from kvstore.layout import KVLayout
from kvstore.lower.local import LocalTier
from kvstore.policy.s3fifo import S3FIFOIndex
from kvstore.store.tiered import TieredStore
from kvstore.tiers.base import Tier
from kvstore.tiers.lmdb.tier import DiskTier

MODEL = {"model_id": "every-path", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float16"}
LAYOUT = KVLayout(**MODEL)  # type: ignore[arg-type]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def config(tmp_path: Path) -> Iterator[Path]:
    """One config naming s3fifo, lmdb, a remote tier (nothing listens: connected lazily, a miss) and
    non-default write policies; a short socket path for the daemon."""
    short = Path(f"/tmp/kvp{tmp_path.name[-12:]}")
    short.mkdir(exist_ok=True)
    data: dict[str, Any] = {
        "model": MODEL,
        "tiers": ["host", "lmdb", "remote"],
        "gpu": {"num_blocks": 16, "device": "cpu"},
        "host": {"capacity": 64 * LAYOUT.bytes_per_block},
        "disk": {"path": str(tmp_path / "lmdb"), "max_size": "16MiB"},
        "remote": {"url": f"redis://127.0.0.1:{_closed_port()}/0", "write": "write_through_selective",
                   "group_blocks": 2},
        "policy": {"placement": "s3fifo", "write": "write_through_selective"},
        "daemon": {"socket_path": str(short / "d.sock"), "layouts": "model"},
        "metrics": {"enabled": False},
    }
    path = tmp_path / "kvstore.yaml"
    path.write_text(yaml.safe_dump(data))
    yield path
    for p in short.iterdir():
        p.unlink()
    short.rmdir()


def order_of(tier: Tier) -> object:
    """The eviction order a host or disk tier runs (the attribute each keeps it in)."""
    return tier._order if hasattr(tier, "_order") else getattr(tier, "_lru")


def assert_stack_as_configured(backend: DaemonBackend, cfg: KVStoreConfig) -> None:
    """The daemon's stack (also the in-process one's): S3-FIFO host and LMDB disk, the remote tier linked
    with ``remote.write``."""
    assert isinstance(order_of(backend.host), S3FIFOIndex)
    assert isinstance(backend.disk, DiskTier) and isinstance(order_of(backend.disk), S3FIFOIndex)
    assert backend.link is not None and backend.link.write == cfg.remote.write == "write_through_selective"


def test_the_embedded_store(config: Path) -> None:
    cfg = load_config(config)
    store = TieredStore.from_config(cfg)
    try:
        assert store.h.host is not None and isinstance(order_of(store.h.host), S3FIFOIndex)
        assert isinstance(store.h.disk, DiskTier) and isinstance(order_of(store.h.disk), S3FIFOIndex)
        assert store.h.remote is not None and store.remote_writer is not None
        assert store.remote_writer.policy.write == "write_through_selective"
        assert store.policy.write == "write_through_selective"
    finally:
        store.close()


@pytest.mark.parametrize("opener", ["engine_store", "sglang"])
def test_the_in_process_stacks(config: Path, opener: str) -> None:
    cfg = load_config(config)
    if opener == "engine_store":
        store = EngineBlockStore.open(cfg, LAYOUT)
        assert len(store.tiers) == 1
        tier = store.tiers[0]
    else:
        tier = open_page_store(cfg, "every-path")
    try:
        assert isinstance(tier, LocalTier)
        assert_stack_as_configured(tier.backend, cfg)
        assert tier.probes_by_chain  # lookups go by chain position: the remote tier's groups
    finally:
        tier.close()


def test_the_daemon_and_a_sidecar_engine_store_writing_into_it(config: Path) -> None:
    cfg = load_config(config)
    server = DaemonServer(cfg)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop = asyncio.Event()

    async def serve() -> None:
        await server.start()
        started.set()
        await stop.wait()
        await server.stop()

    runner = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    runner.start()
    try:
        assert started.wait(30)
        assert server.backend is not None
        assert_stack_as_configured(server.backend, cfg)
        store = EngineBlockStore.open(cfg.model_copy(update={"connector": "sidecar"}), LAYOUT)
        try:
            assert isinstance(store.tiers[0], DaemonTier)
            key = bytes(range(32))
            block = torch.arange(LAYOUT.bytes_per_block, dtype=torch.int32).to(torch.uint8)
            assert store.put([key], [block]) == [True]
            assert server.backend.host.slot_of(key) is not None  # the sidecar's block is in that stack
            assert key in order_of(server.backend.host)  # type: ignore[operator]
        finally:
            store.close()
    finally:
        loop.call_soon_threadsafe(stop.set)
        runner.join(30)
        loop.close()
