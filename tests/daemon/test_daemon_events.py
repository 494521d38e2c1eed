"""The daemon publishes KV events of its own tiers, and a router counts them for the replicas sharing it.

Backend level: the exact, ordered events of puts, write-behind, host evictions, disk reads copied up, and
deletes. Process level: a real ``kvstore serve --events-endpoint`` followed by the router's subscriber as a
store serving one replica; a late router recovers from the full report; a restarted daemon announces what
its disk still holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from daemonlib import LAYOUT, Daemon, block_for, cleanup, free_port, keys_for, short_tmpdir, start_daemon, write_config
from kvstore.daemon.server.backend import DaemonBackend
from kvstore.daemon.server.holds import HoldTable
from kvstore.daemon.client.tier import DaemonTier
from kvstore.events import StoreEvent
from kvstore.config.write_policy import WritePolicy
from kvstore.lower.write_policy import WriteRule
from kvstore.route.index import PrefixHit, RouterIndex
from kvstore.route.subscriber import EventSubscriber, StoreEndpoints
from kvstore.tiers.lmdb.tier import DiskTier
from kvstore.tiers.host.tier import HostTier



def _events(backend: DaemonBackend) -> list[tuple[str, str, bytes]]:
    assert backend.events is not None
    return [(e.kind, e.tier, e.key) for e in backend.events.drain()]


def _put(backend: DaemonBackend, keys: list[bytes]) -> None:
    assert backend.put_inline(keys, [memoryview(block_for(k).numpy()) for k in keys]) == [True] * len(keys)


def _backend(tmp_path: Path, write: WritePolicy) -> DaemonBackend:
    host = HostTier(LAYOUT, 4 * LAYOUT.bytes_per_block, pin_memory="never", auto_evict=True)
    disk = DiskTier(LAYOUT, str(tmp_path / "lmdb"), 16 << 20, sync="interval", map_step=1 << 20)
    return DaemonBackend(LAYOUT, host, disk, HoldTable(60.0), publish_events=True, write=WriteRule(write))


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[DaemonBackend]:
    """Written through: every put's disk copy is an event right after its host one."""
    b = _backend(tmp_path, "write_through")
    yield b
    b.close()


def test_under_write_back_the_disk_event_comes_when_a_block_is_written_back(tmp_path: Path) -> None:
    b = _backend(tmp_path, "write_back")
    try:
        k = keys_for(3, seed=34)
        assert b.writer is not None
        _put(b, k[:2])
        b.writer.drain()
        assert _events(b) == [("stored", "host", x) for x in k[:2]]  # dirty: in host only
        b.flush()
        assert sorted(_events(b)) == sorted(("stored", "disk", x) for x in k[:2])
        assert b.events is not None and set(b.events.holdings()["disk"]) == set(k[:2])
    finally:
        b.close()


def test_puts_write_behind_evictions_reads_and_deletes_are_events_in_order(backend: DaemonBackend) -> None:
    k = keys_for(7, seed=31)
    assert backend.writer is not None
    _put(backend, k[:3])
    backend.writer.drain()  # published in host at once; the write-behind thread stores them on disk after
    assert _events(backend) == [("stored", "host", x) for x in k[:3]] + [("stored", "disk", x) for x in k[:3]]

    _put(backend, k[3:5])  # 4 host slots; a put marks its last key least recent (a prefix's tail goes first)
    backend.writer.drain()
    assert _events(backend) == [("evicted", "host", k[2]), ("stored", "host", k[3]), ("stored", "host", k[4]),
                                ("stored", "disk", k[3]), ("stored", "disk", k[4])]

    assert backend.read_inline([k[2]])[0] == block_for(k[2]).numpy().tobytes()  # a disk hit copied up to host
    assert _events(backend) == [("evicted", "host", k[1]), ("stored", "host", k[2])]

    assert backend.delete([k[2], k[6]]) == 1  # k6 was never stored: no event for it
    assert _events(backend) == [("evicted", "host", k[2]), ("evicted", "disk", k[2])]
    assert _events(backend) == []


def test_the_holdings_are_what_each_tier_has(backend: DaemonBackend) -> None:
    k = keys_for(5, seed=32)
    assert backend.writer is not None
    _put(backend, k[:4])
    backend.writer.drain()  # the host slots being written are pinned until then
    _put(backend, k[4:])  # evicts the least recent, k3
    backend.writer.drain()
    assert backend.events is not None
    held = backend.events.holdings()
    assert held == {"host": [k[2], k[1], k[0], k[4]], "disk": [k[3], k[2], k[1], k[0], k[4]]}  # next to evict first


def test_without_publishing_the_tiers_record_nothing() -> None:
    host = HostTier(LAYOUT, 2 * LAYOUT.bytes_per_block, pin_memory="never", auto_evict=True)
    b = DaemonBackend(LAYOUT, host, None, HoldTable(60.0))
    try:
        keys = keys_for(4, seed=33)
        _put(b, keys[:2])
        _put(b, keys[2:])  # evicts both earlier blocks
        assert host.stats().evictions == 2
        assert b.events is None and host.events_queued == 0
    finally:
        b.close()


# ------------------------------------------------------------------ a real daemon and a router
def _start(root: Path, ports: tuple[int, int], **over: object) -> tuple[Daemon, str, str]:
    events = {"enabled": True, "endpoint": f"tcp://127.0.0.1:{ports[0]}",
              "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}", "interval_s": 0.02, **over}
    cfg = write_config(root, host={"capacity": 8 * LAYOUT.bytes_per_block}, daemon={"events": events})
    d = start_daemon(cfg)
    return d, f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"


def _router(events: str, replay: str) -> tuple[EventSubscriber, RouterIndex]:
    index = RouterIndex()
    for r in ("r1", "r2"):
        index.add_replica(r)
    sub = EventSubscriber(index, {}, stores={"daemon": StoreEndpoints(events, replay, ("r1",))}, replay_timeout_s=5.0)
    sub.start()
    return sub, index


def _until(check: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def _put_until(tier: DaemonTier, check: Callable[[], bool], seed: int) -> bool:
    """Put one new block (one batch of events) at a time until ``check()``: a router that missed a batch
    learns of the gap only from the next one it gets."""
    for k in keys_for(100, seed=seed):
        if check():
            return True
        assert tier.put([k], [block_for(k)]) == [True]
        time.sleep(0.1)
    return check()


def _hit(sub: EventSubscriber, index: RouterIndex, keys: list[bytes]) -> dict[str, PrefixHit]:
    with sub.lock:
        return index.cached_prefix(keys)


def test_a_router_counts_the_daemons_blocks_for_the_replica_sharing_it() -> None:
    root = short_tmpdir()
    d = None
    sub = None
    ports = (free_port(), free_port())
    try:
        d, events, replay = _start(root, ports)
        sub, index = _router(events, replay)
        tier = d.tier()
        keys = keys_for(3, seed=34)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 3
        tier.flush()
        assert _until(lambda: _hit(sub, index, keys)["r1"] == PrefixHit(3, {"host": 3}))
        assert _hit(sub, index, keys)["r2"] == PrefixHit(0, {})  # r2 does not share this daemon
        assert _until(lambda: index.tiers("daemon", keys[0]) == {"host", "disk"})

        tier.delete(keys[1:2])
        assert _until(lambda: _hit(sub, index, keys)["r1"] == PrefixHit(1, {"host": 1}))
        tier.close()

        assert d.stop() == 0
        d, _, _ = _start(root, ports)
        # Its batch 0 is a full report of what its disk kept (an empty host tier). The router may miss it
        # (a SUB socket reconnects ~100 ms after the restart); then the next batch's seq, lower than the
        # last one seen, makes it ask for the full report: either way it ends where the daemon is.
        tier = d.tier()
        assert _put_until(tier, lambda: _hit(sub, index, keys)["r1"] == PrefixHit(1, {"disk": 1}), seed=37)
        assert index.tiers("daemon", keys[1]) == set() and index.tiers("daemon", keys[2]) == {"disk"}
        assert sub.feeds["daemon"].restarts + sub.feeds["daemon"].backwards >= 1
        tier.close()
        index.check_integrity()
    finally:
        if sub is not None:
            sub.close()
        cleanup(d, root)


def test_a_late_router_recovers_the_daemons_blocks_from_its_full_report() -> None:
    root = short_tmpdir()
    d = None
    sub = None
    try:
        d, events, replay = _start(root, (free_port(), free_port()), buffer_batches=1)
        tier = d.tier()
        keys = keys_for(4, seed=35)
        for k in keys:  # one batch each, at least: more than the one batch buffered for replay
            assert tier.put([k], [block_for(k)]) == [True]
            time.sleep(0.05)
        sub, index = _router(events, replay)
        assert _put_until(tier, lambda: _hit(sub, index, keys)["r1"].blocks == 4, seed=36)
        assert sub.feeds["daemon"].full_reports >= 1 and sub.feeds["daemon"].replays == 0
        tier.close()
    finally:
        if sub is not None:
            sub.close()
        cleanup(d, root)


def test_a_bad_events_endpoint_is_refused_naming_the_flag() -> None:
    import subprocess
    import sys

    cfg = write_config(short_tmpdir())
    out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(cfg), "--events-endpoint",
                          "http://x"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--events-endpoint" in out.stderr and "not a ZMQ address" in out.stderr


def test_store_event_kinds_are_what_the_router_translates() -> None:
    from kvstore.route.translate import kv_events

    got = kv_events([StoreEvent("stored", b"k" * 32, "host"), StoreEvent("evicted", b"k" * 32, "disk")], 4)
    assert [(type(e).__name__, e.medium) for e in got] == [("BlockStored", "CPU"), ("BlockRemoved", "STORAGE")]
