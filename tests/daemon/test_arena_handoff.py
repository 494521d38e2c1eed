"""The daemon's shared arena reaches a local client only as a descriptor passed at login, and nobody can
shrink it: a local process that truncated the named POSIX segment killed the daemon with SIGBUS at its next
copy (issue 30 item 8). Now the arena is a sealed memfd (:mod:`kvstore.tiers.arena`): no name in /dev/shm to
open, ``ftruncate`` refused with ``EPERM`` to a client holding the descriptor and to a process that finds it
under ``/proc/<daemon>/fd``, and the daemon serves on with every block's bytes intact."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from daemonlib import (
    Daemon, block_for, cleanup, dev_shm, empty_blocks, keys_for, maps_arena, raw_login, raw_stats, raw_unix,
    short_tmpdir, start_daemon, write_config,
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    before = dev_shm()
    d = start_daemon(write_config(root))
    try:
        assert dev_shm() == before  # the daemon created nothing another process could open by name
        yield d
    finally:
        cleanup(d, root)


def _daemons_arena_fds(pid: int) -> list[int]:
    """The daemon's open descriptors that are its arena (found the way any process of its user could)."""
    found = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith("/memfd:kvstore-"):
                found.append(int(name))
        except OSError:
            continue  # closed meanwhile
    return found


def _served_intact(d: Daemon, keys: list[bytes]) -> None:
    tier = d.tier(client_name="checker")
    dests = empty_blocks(len(keys))
    assert tier.get(keys, dests) == [True] * len(keys)
    wrong = [k[:4].hex() for k, b in zip(keys, dests) if not bool((b == block_for(k)).all())]
    assert not wrong, f"blocks served with other bytes: {wrong}"
    tier.close()


def test_a_client_holding_the_arena_cannot_shrink_or_grow_it(daemon: Daemon) -> None:
    writer = daemon.tier(client_name="writer")
    keys = keys_for(32, seed=3001)
    assert writer.put(keys, [block_for(k) for k in keys]) == [True] * 32
    with raw_unix(daemon) as s:
        fd = raw_login(s, want_shm=True, keep_arena=True)
        assert fd is not None
        try:
            size = os.fstat(fd).st_size
            for to in (0, 4096, size - 1, size + (1 << 20)):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, to)
            assert os.fstat(fd).st_size == size
        finally:
            os.close(fd)
        assert raw_stats(s, 2)["host"]["puts"] >= 32  # this connection, and the daemon, still serve
    _served_intact(daemon, keys)
    writer.close()


def test_a_process_reaching_the_arena_through_proc_cannot_shrink_it(daemon: Daemon) -> None:
    """The path a local process of the daemon's user has without logging in: the daemon's own descriptor."""
    writer = daemon.tier(client_name="writer")
    keys = keys_for(32, seed=3002)
    assert writer.put(keys, [block_for(k) for k in keys]) == [True] * 32
    assert maps_arena(daemon.proc.pid)
    fds = _daemons_arena_fds(daemon.proc.pid)
    assert fds, "the daemon holds its arena's descriptor"
    for fd in fds:
        with open(f"/proc/{daemon.proc.pid}/fd/{fd}", "r+b") as f:
            with pytest.raises(PermissionError):
                os.ftruncate(f.fileno(), 0)
    assert daemon.proc.poll() is None
    _served_intact(daemon, keys)
    writer.close()


def test_a_client_that_asks_for_no_shared_memory_gets_no_descriptor(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        assert raw_login(s, want_shm=False, keep_arena=True) is None
        stats = raw_stats(s, 2)  # the next bytes are STATS' reply: nothing (no descriptor) came in between
        assert "host" in stats
        s.setblocking(False)
        with pytest.raises(BlockingIOError):
            socket.recv_fds(s, 1, 1)
