"""Each remote write policy (``remote.write``) exists once: the embedded store and the daemon's stack send the
same groups.

The same sequence runs through an embedded :class:`~kvstore.store.tiered.TieredStore` and through the in-process
daemon stack (:class:`~kvstore.lower.local.LocalTier`, the daemon's :class:`~kvstore.daemon.server.backend.DaemonBackend`),
both built from one config, each on its own key prefix of one real ``redis-server``: a prompt ``A`` of two full
groups and a partial one is stored, hit twice, then a prompt ``B`` as large as the disk tier pushes all of ``A``
out of it. Under each writing policy both paths must leave the same groups (the same keys) in Redis, readable back
bit for bit, and both must be run by the one policy object, :class:`~kvstore.lower.remote_write.RemoteWritePolicy`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
import time
from typing import Any

import pytest
import redis
import torch

from benchmarks.redis_servers import RedisServer, redis_missing, start_server
from kvstore.config.schema import KVStoreConfig
from kvstore.layout import KVLayout
from kvstore.lower.local import LocalTier
from kvstore.lower.remote_write import RemoteWritePolicy, completed_groups, full_groups
from kvstore.store.tiered import TieredStore
from kvstore.tiers.redis.tier import RedisTier

MODEL = {"model_id": "remote-once", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4,
         "dtype": "float16"}
LAYOUT = KVLayout(**MODEL)  # type: ignore[arg-type]
G = 4
DISK_BLOCKS = 12
"""Blocks the file tier holds (one 4 KiB file each)."""
A_BLOCKS = 10
"""Two full groups and a partial one (never sent)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    why = redis_missing()
    if why is not None:
        pytest.fail(f"the one-remote-policy test needs redis-server: {why} (scripts/ensure_redis.sh installs it)")
    srv = start_server(tmp_path_factory.mktemp("redis"))
    try:
        yield srv
    finally:
        srv.stop()


def _config(root: Path, url: str, write: str, prefix: str, local_write: str = "write_through") -> KVStoreConfig:
    """Host, a small file tier and the remote tier; the local tiers written through by default (every block on
    disk at its commit, in both paths), LRU placement (the disk evicts the oldest blocks: the same ones in both
    paths)."""
    return KVStoreConfig.model_validate({
        "model": MODEL, "tiers": ["host", "file", "remote"],
        "gpu": {"num_blocks": 32, "device": "cpu"},
        "host": {"capacity": 256 * LAYOUT.bytes_per_block},
        "file": {"path": str(root / "files"), "max_size": DISK_BLOCKS * 4096},
        "remote": {"url": url, "group_blocks": G, "key_prefix": prefix, "write": write, "selective_hits": 2,
                   "timeout_s": 2.0, "probe_timeout_s": 5.0},
        "policy": {"placement": "lru", "write": local_write},
        "metrics": {"enabled": False},
    })


def _prompt(n_blocks: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n_blocks * LAYOUT.block_size + 1,), generator=g).tolist()


def _blocks(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (LAYOUT.bytes_per_block,), dtype=torch.uint8, generator=g) for _ in range(n)]


class EmbeddedPath:
    """The embedded store: lookups, then prefill (allocate, write the blocks, commit, free)."""

    def __init__(self, cfg: KVStoreConfig) -> None:
        self.store = TieredStore.from_config(cfg)
        assert self.store.remote_writer is not None
        self.policy: Any = self.store.remote_writer.policy

    def store_chain(self, toks: list[int], data: list[torch.Tensor]) -> list[bytes]:
        keys = self.store.keys(toks)
        self.store.lookup(toks)  # what an engine does first (nothing local yet)
        ids = self.store.allocate(len(keys))
        for b, d in zip(ids, data):
            self.store.h.pool.block_bytes(b).copy_(d)
        self.store.commit(keys, ids, toks)
        self.store.free(ids)
        self.flush()
        return keys

    def hit(self, toks: list[int]) -> None:
        assert len(self.store.lookup(toks).tiers) == A_BLOCKS  # every block local
        self.flush()

    def on_disk(self, keys: list[bytes]) -> list[bool]:
        assert self.store.h.disk is not None
        return [self.store.h.disk.contains(k) for k in keys]

    def flush(self) -> None:
        self.store.flush()

    def close(self) -> None:
        self.store.close()


class DaemonPath:
    """The daemon's stack in this process: a chain probe (how the daemon learns the groups), then a put."""

    def __init__(self, cfg: KVStoreConfig) -> None:
        self.tier = LocalTier.from_config(cfg, LAYOUT)
        assert self.tier.backend.link is not None
        self.policy: Any = self.tier.backend.link.policy

    def store_chain(self, keys: list[bytes], data: list[torch.Tensor]) -> None:
        assert self.tier.probe(keys, 0) == 0
        assert all(self.tier.put(keys, data))
        self.flush()

    def hit(self, keys: list[bytes]) -> None:
        assert self.tier.probe(keys, 0) == A_BLOCKS  # every block local
        self.flush()

    def on_disk(self, keys: list[bytes]) -> list[bool]:
        disk = self.tier.backend.disk
        assert disk is not None
        return [disk.contains(k) for k in keys]

    def flush(self) -> None:
        self.tier.flush()  # once: it waits for the sends its own disk writes' evictions queued

    def close(self) -> None:
        self.tier.close()


def _stored(url: str, prefix: str) -> set[str]:
    """The last keys (hex) of the groups stored under ``prefix``."""
    client = redis.Redis.from_url(url)
    try:
        return {k.decode()[len(prefix):] for k in client.scan_iter(match=prefix + "*")}
    finally:
        client.close()


def _read_back(url: str, prefix: str, chains: list[tuple[list[bytes], list[torch.Tensor]]], groups: set[str]) -> None:
    """Every stored group loads back bit for bit."""
    from kvstore.config.remote import RemoteConfig

    tier = RedisTier(LAYOUT, RemoteConfig(url=url, group_blocks=G, key_prefix=prefix, listen_evictions=False))
    try:
        found = 0
        for keys, data in chains:
            for start in range(0, len(keys) // G * G, G):
                if keys[start + G - 1].hex() not in groups:
                    continue
                dests = [torch.empty(LAYOUT.bytes_per_block, dtype=torch.uint8) for _ in range(G)]
                assert tier.load(keys, start, dests) == [True] * G
                assert all(torch.equal(d, x) for d, x in zip(dests, data[start:start + G]))
                found += 1
        assert found == len(groups)
    finally:
        tier.close()


@pytest.mark.parametrize("write", ["write_through", "write_through_selective", "write_back"])
def test_both_paths_store_the_same_groups(server: RedisServer, tmp_path: Path, write: str) -> None:
    a_toks, b_toks = _prompt(A_BLOCKS, seed=1), _prompt(DISK_BLOCKS, seed=2)
    a_data, b_data = _blocks(A_BLOCKS, seed=3), _blocks(DISK_BLOCKS, seed=4)
    prefixes = {"embedded": f"{write}:embedded:", "daemon": f"{write}:daemon:"}
    embedded = EmbeddedPath(_config(tmp_path / "e", server.url, write, prefixes["embedded"]))
    daemon = DaemonPath(_config(tmp_path / "d", server.url, write, prefixes["daemon"]))
    try:
        assert type(embedded.policy) is RemoteWritePolicy and type(daemon.policy) is RemoteWritePolicy
        assert embedded.policy.write == daemon.policy.write == write
        a_keys = embedded.store_chain(a_toks, a_data)
        b_keys = embedded.store.keys(b_toks)
        daemon.store_chain(a_keys, a_data)
        for _ in range(2):  # selective_hits: 2
            embedded.hit(a_toks)
            daemon.hit(a_keys)
        embedded.store_chain(b_toks, b_data)  # as large as the disk: every block of A leaves it
        daemon.store_chain(b_keys, b_data)
        for path in (embedded, daemon):
            assert path.on_disk(a_keys) == [False] * A_BLOCKS and path.on_disk(b_keys) == [True] * DISK_BLOCKS
        a_groups = {a_keys[i].hex() for i in (G - 1, 2 * G - 1)}
        b_groups = {b_keys[i].hex() for i in range(G - 1, DISK_BLOCKS, G)}
        expected = {"write_through": a_groups | b_groups, "write_through_selective": a_groups,
                    "write_back": a_groups}[write]
        stored = {name: _stored(server.url, p) for name, p in prefixes.items()}
        assert stored["embedded"] == stored["daemon"] == expected
        for name, p in prefixes.items():
            _read_back(server.url, p, [(a_keys, a_data), (b_keys, b_data)], stored[name])
        for path in (embedded, daemon):
            assert (path.policy.counters.incomplete, path.policy.counters.shed) == (0, 0)
    finally:
        embedded.close()
        daemon.close()


def test_one_daemon_flush_waits_for_the_sends_its_disk_evictions_queue(server: RedisServer, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``remote.write: write_back`` with the host tier written back too: A is stored and flushed to disk,
    then B, as large as the disk, stays dirty in host until the next flush, whose disk writes evict A; the
    evictions queue A's groups for Redis. That one flush returns only once they are stored: a FLUSH covers the
    remote copies its own disk writes made due. Each store is slowed (a server farther away), so a flush that
    did not wait for them would return first."""
    prefix = "flush-once:"
    daemon = DaemonPath(_config(tmp_path, server.url, "write_back", prefix, local_write="write_back"))
    assert daemon.tier.backend.link is not None
    remote = daemon.tier.backend.link.remote
    store = remote.store

    def slow_store(*args: Any, **kwargs: Any) -> int:
        time.sleep(0.3)
        return store(*args, **kwargs)

    monkeypatch.setattr(remote, "store", slow_store)
    try:
        a_keys = [bytes([1, i]) * 16 for i in range(A_BLOCKS)]
        b_keys = [bytes([2, i]) * 16 for i in range(DISK_BLOCKS)]
        daemon.store_chain(a_keys, _blocks(A_BLOCKS, seed=3))  # probed (its groups known), put, flushed
        assert daemon.on_disk(a_keys) == [True] * A_BLOCKS
        assert daemon.tier.probe(b_keys, 0) == 0
        assert all(daemon.tier.put(b_keys, _blocks(DISK_BLOCKS, seed=4)))
        dirty = daemon.tier.backend.dirty
        assert dirty is not None and len(dirty) == DISK_BLOCKS  # B is written down by the flush, not before
        assert _stored(server.url, prefix) == set()
        daemon.tier.flush()
        assert daemon.on_disk(a_keys) == [False] * A_BLOCKS and daemon.on_disk(b_keys) == [True] * DISK_BLOCKS
        assert _stored(server.url, prefix) == {a_keys[i].hex() for i in (G - 1, 2 * G - 1)}
        assert not daemon.policy.pending()
    finally:
        daemon.close()


def test_the_group_arithmetic() -> None:
    """Groups are spans of ``G`` chain positions; a commit completes those whose last position it adds."""
    chain = [bytes([i]) * 32 for i in range(10)]
    assert full_groups(chain, 4) == [tuple(chain[0:4]), tuple(chain[4:8])]
    assert full_groups(chain, 4, stop=7) == [tuple(chain[0:4])]
    assert completed_groups(chain, 8, 4) == []  # positions 8, 9: group 2 is not full yet
    assert completed_groups(chain[:8], 3, 4) == [tuple(chain[0:4]), tuple(chain[4:8])]
    assert completed_groups(chain[:8], 4, 4) == [tuple(chain[4:8])]  # group 0 was complete before
    assert completed_groups(chain + [b"x" * 32, b"y" * 32], 10, 4) == [(*chain[8:10], b"x" * 32, b"y" * 32)]
