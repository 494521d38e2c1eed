"""Durability and lifecycle: kill -9 while clients write, SIGTERM, restart, reconnection, a second daemon."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from daemonlib import (
    REPO, assert_acknowledged_survive, block_for, cleanup, empty_blocks, keys_for, dev_shm, maps_arena, short_tmpdir, signal_name,
    start_daemon, write_config,
)
from kvstore.errors import TierError


def test_kill9_loses_nothing_flushed_and_serves_nothing_corrupt() -> None:
    root = short_tmpdir()
    daemon = None
    try:
        config = write_config(root, disk={"sync": "interval", "sync_interval_ms": 10_000})  # only FLUSH syncs
        daemon = start_daemon(config)
        flushed: list[list[bytes]] = [[] for _ in range(3)]
        attempted: list[list[bytes]] = [[] for _ in range(3)]
        rounds = [0]

        def writer(w: int) -> None:
            tier = daemon.tier(client_name=f"writer {w}", backoff_initial_s=5.0)
            for i in range(10_000):
                keys = keys_for(6, seed=10_000 * (w + 1) + i)
                attempted[w].extend(keys)
                ok = tier.put(keys, [block_for(k) for k in keys])
                try:
                    tier.flush()
                except TierError:
                    return  # the daemon died: nothing after this is acknowledged
                flushed[w].extend(k for k, o in zip(keys, ok) if o)
                rounds[0] += 1

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while rounds[0] < 30 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
        for t in threads:
            t.join(30)
        acked = [k for ks in flushed for k in ks]
        assert len(acked) >= 30 * 6

        daemon = start_daemon(config)  # same config: the stale socket is cleared (the killed daemon's arena died with it)
        tier = daemon.tier(client_name="checker")
        assert_acknowledged_survive(tier, attempted, acked, "flushed")
        stats = tier.client.stats()
        assert stats["disk"]["corrupt_dropped"] == 0
        tier.close()
        assert daemon.stop() == 0
    finally:
        cleanup(daemon, root)


def test_sigterm_flushes_cleans_up_and_clients_reconnect() -> None:
    root = short_tmpdir()
    daemon = None
    try:
        config = write_config(root, disk={"sync": "interval", "sync_interval_ms": 10_000})
        daemon = start_daemon(config)
        tier = daemon.tier(client_name="survivor", backoff_initial_s=0.01)
        assert tier.client.hello.shm_name is not None and maps_arena(daemon.proc.pid)  # type: ignore[union-attr]
        keys = keys_for(20, seed=42)
        assert all(tier.put(keys, [block_for(k) for k in keys]))  # acknowledged, never explicitly flushed
        rc = daemon.stop(signal.SIGTERM)
        assert rc == 0, signal_name(rc)
        log = daemon.log.read_text()
        assert "flushed: every acknowledged block is on disk" in log and "stopped" in log
        assert not os.path.exists(daemon.socket_path)

        assert tier.contains_prefix(keys) == 0  # daemon down: the tier degrades to misses, it does not raise
        daemon = start_daemon(config)
        deadline = time.monotonic() + 10
        while tier.contains_prefix(keys) != 20 and time.monotonic() < deadline:  # reconnects with backoff
            time.sleep(0.05)
        dests = empty_blocks(20)
        assert tier.get(keys, dests) == [True] * 20
        assert all(torch.equal(d, block_for(k)) for k, d in zip(keys, dests))
        assert tier.client.generation == 2
        tier.close()
    finally:
        cleanup(daemon, root)


def test_second_daemon_on_a_live_socket_refuses_to_start(tmp_path: Path) -> None:
    root = short_tmpdir()
    daemon = None
    try:
        config = write_config(root)
        daemon = start_daemon(config)
        out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(config)],
                             capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 1
        assert "another daemon is serving on" in out.stderr
        assert daemon.proc.poll() is None and os.path.exists(daemon.socket_path)
    finally:
        cleanup(daemon, root)


@pytest.mark.parametrize("bad", ["not-a-socket"])
def test_socket_path_that_is_a_file_is_not_replaced(bad: str) -> None:
    root = short_tmpdir()
    try:
        (root / "d.sock").write_text(bad)
        out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(write_config(root))],
                             capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 1 and "exists and is not a socket" in out.stderr
        assert (root / "d.sock").read_text() == bad
    finally:
        cleanup(None, root)


def test_metrics_port_in_use_is_a_one_line_error_and_leaves_nothing_behind() -> None:
    root = short_tmpdir()
    before = dev_shm()
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            config = write_config(root, metrics={"host": "127.0.0.1", "port": port}, logging={"level": "WARNING"})
            out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(config)],
                                 capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 1
        assert out.stderr == (f"error: cannot start the daemon: metrics.port {port}: cannot listen on "
                              f"127.0.0.1:{port} (Address already in use)\n")
        assert not (root / "d.sock").exists()
        assert dev_shm() == before  # and no segment: the arena is a memfd that died with the process
    finally:
        cleanup(None, root)


def test_a_second_daemon_never_removes_a_paused_daemons_socket() -> None:
    """A paused first daemon with a full accept backlog (a connect fails) still owns its socket path.

    The second daemon has its own data directory (and, as every daemon, its own arena), so only the socket path is
    shared: it must be refused naming the first daemon's pid, and leave the socket file in place.
    """
    root, other = short_tmpdir(), short_tmpdir()
    first = None
    fillers: list[socket.socket] = []
    try:
        first = start_daemon(write_config(root))
        inode = os.stat(first.socket_path).st_ino
        first.proc.send_signal(signal.SIGSTOP)
        for _ in range(5000):  # fill the paused daemon's accept backlog until a connect is refused for room
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(first.socket_path)
            except BlockingIOError:
                s.close()
                break
            fillers.append(s)
        else:
            raise AssertionError("the accept backlog never filled")
        second = write_config(other, daemon={"socket_path": first.socket_path})
        out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(second)],
                             capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 1, out.stderr[-2000:]
        assert "another daemon is serving on" in out.stderr and f"pid {first.proc.pid}" in out.stderr
        assert os.stat(first.socket_path).st_ino == inode  # the live daemon's socket file, untouched
        for s in fillers:
            s.close()
        fillers.clear()
        first.proc.send_signal(signal.SIGCONT)
        tier = first.tier()  # and the first daemon still serves on it
        keys = keys_for(2, seed=91)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True, True]
        tier.close()
    finally:
        for s in fillers:
            s.close()
        if first is not None and first.proc.poll() is None:
            first.proc.send_signal(signal.SIGCONT)
        cleanup(first, root)
        cleanup(None, other)
