"""kvstore behind SGLang's HiCache L3 interface through a real ``kvstore serve`` daemon (``connector: sidecar``).

Pages stored by one backend (one SGLang process) are found by another and
after a daemon restart; a page damaged on the daemon's disk is a miss; a
daemon-assigned tenant salt keeps tenants apart.
"""

from __future__ import annotations

from sglang_stubs import require_sglang

require_sglang()

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
import torch

from daemonlib import Daemon, cleanup, short_tmpdir, start_daemon
from sglanglib import device_pool, fill_pages, host_pool, open_backend, page_hashes, pages_at, write_kvstore_config

TOKEN = "admin-token"
A_TOKEN, B_TOKEN = "token-of-tenant-a", "token-of-tenant-b"


@pytest.fixture
def root() -> Iterator[Path]:
    path = short_tmpdir()  # AF_UNIX paths are short
    yield path
    cleanup(None, path)


def _daemon_config(root: Path) -> Path:
    return write_kvstore_config(root, "daemon.yaml", connector="sidecar", daemon={
        "token": TOKEN, "tenant_salts": {A_TOKEN: "salt-a", B_TOKEN: "salt-b"}})


def _client_config(root: Path, token: str, name: str) -> Path:
    """A client's kvstore config: the daemon's, with this client's token."""
    return write_kvstore_config(root, name, connector="sidecar", daemon={"token": token})


def test_pages_round_trip_between_processes_and_survive_a_daemon_restart(root: Path) -> None:
    daemon: Daemon | None = start_daemon(_daemon_config(root))
    try:
        kv = device_pool()
        host = host_pool(kv)
        client = _client_config(root, TOKEN, "client.yaml")
        writer = open_backend(client, host, interface_v1=1)
        keys = page_hashes(4)
        src = fill_pages(host, 4, seed=11)
        assert writer.batch_set_v1(keys, src) == [True] * 4
        assert writer.batch_exists(keys + page_hashes(1, seed="more")) == 4
        writer.close()  # flushes: the daemon has them on disk

        reader_host = host_pool(device_pool())  # another engine's pools
        reader = open_backend(client, reader_host)
        dst = reader_host.alloc(16)
        assert reader.batch_get_v1(keys, dst) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(pages_at(reader_host, dst), pages_at(host, src)))
        reader.close()

        assert daemon.stop(signal.SIGTERM) == 0
        daemon = start_daemon(_daemon_config(root))
        again = open_backend(client, reader_host)
        assert again.batch_exists(keys) == 4
        flat = again.batch_get(keys)
        assert all(f is not None and torch.equal(f, w) for f, w in zip(flat, pages_at(host, src)))
        again.close()
    finally:
        cleanup(daemon, root / "none")


def test_a_page_damaged_on_the_daemons_disk_is_a_miss(root: Path) -> None:
    daemon: Daemon | None = start_daemon(_daemon_config(root))
    try:
        host = host_pool(device_pool())
        client = _client_config(root, TOKEN, "client.yaml")
        backend = open_backend(client, host, interface_v1=1)
        keys = page_hashes(3, seed="damage")
        src = fill_pages(host, 3, seed=5)
        assert backend.batch_set_v1(keys, src) == [True] * 3
        damaged = backend.keys_of(keys)[1]
        backend.close()
        assert daemon.stop(signal.SIGTERM) == 0  # flushed to LMDB; its host (shm) tier is gone
        env = lmdb.open(os.fspath(root / "lmdb"), max_dbs=2)
        blocks = env.open_db(b"blocks")
        with env.begin(write=True, db=blocks) as txn:
            value = bytearray(txn.get(damaged))
            value[-5] ^= 0x01
            txn.put(damaged, bytes(value))
        env.close()

        daemon = start_daemon(_daemon_config(root))
        backend = open_backend(client, host, interface_v1=1)
        dst = host.alloc(12)
        sentinel = torch.full_like(host.get_data_page(int(dst[4])), -2.0)
        host.set_from_flat_data_page(int(dst[4]), sentinel)
        assert backend.batch_get_v1(keys, dst) == [True, False, True]
        got, want = pages_at(host, dst), pages_at(host, src)
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]) and torch.equal(got[1], sentinel)
        assert backend.store.stats().corrupt_dropped == 1
        assert backend.batch_exists(keys) == 1
        backend.close()
    finally:
        cleanup(daemon, root / "none")


def test_daemon_assigned_tenants_never_see_each_others_pages(root: Path) -> None:
    daemon = start_daemon(_daemon_config(root))
    try:
        host = host_pool(device_pool())
        keys = page_hashes(2, seed="tenant")
        src = fill_pages(host, 2, seed=9)
        a = open_backend(_client_config(root, A_TOKEN, "a.yaml"), host, tenant="ignored: the daemon decides")
        b = open_backend(_client_config(root, B_TOKEN, "b.yaml"), host)
        assert a.salt == b"salt-a" and b.salt == b"salt-b"
        assert a.batch_set_v1(keys, src) == [True, True]
        assert a.batch_exists(keys) == 2
        assert b.batch_exists(keys) == 0 and b.batch_get_v1(keys, host.alloc(8)) == [False, False]
        a.close()
        b.close()
    finally:
        cleanup(daemon, root / "none")


def test_a_paused_daemon_costs_sglang_its_deadlines_not_the_pause(root: Path) -> None:
    """SIGSTOP of the daemon under SGLang's HiCache calls: each answers within its deadline (a miss, a page not
    stored), then at once behind the open breaker; after SIGCONT the pages stored before are served again."""
    import time

    daemon = start_daemon(_daemon_config(root))
    try:
        host = host_pool(device_pool())
        client = write_kvstore_config(root, "paused.yaml", connector="sidecar", daemon={"token": TOKEN}, deadlines={
            "lookup_ms": 50, "load_floor_ms": 300, "save_ms": 300, "breaker_open_s": 0.2, "breaker_open_max_s": 0.5})
        backend = open_backend(client, host, interface_v1=1)
        keys = page_hashes(4, seed="pause")
        src = fill_pages(host, 4, seed=13)
        assert backend.batch_set_v1(keys, src) == [True] * 4
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert backend.batch_exists(keys) == 0
            assert backend.batch_get_v1(keys, host.alloc(16)) == [False] * 4
            assert backend.batch_set_v1(page_hashes(2, seed="during"), fill_pages(host, 2, seed=14)) == [False] * 2
            for _ in range(100):  # the breaker is open: instant misses
                assert backend.batch_exists(keys) == 0
            elapsed = time.monotonic() - t0
            time.sleep(max(0.0, 3.0 - elapsed))  # a pause longer than all of that
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert elapsed < 2.5, f"SGLang's calls waited {elapsed:.1f} s on a paused daemon"
        t1 = time.monotonic()
        while backend.batch_exists(keys) != 4:  # the breaker's probe finds the daemon again
            assert time.monotonic() - t1 < 10, "the pages stored before the pause are not found after SIGCONT"
            time.sleep(0.1)
        dst = host.alloc(16)
        assert backend.batch_get_v1(keys, dst) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(pages_at(host, dst), pages_at(host, src)))
        backend.close()
    finally:
        if daemon.proc.poll() is None:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        cleanup(daemon, root / "none")
