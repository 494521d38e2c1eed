"""The daemon's shared arena reaches a local client only as a descriptor passed at login, and nobody can
shrink it: a local process that truncated the named POSIX segment killed the daemon with SIGBUS at its next
copy. Now the arena is a sealed memfd (:mod:`kvstore.tiers.host.arena`): no name in /dev/shm to
open, ``ftruncate`` refused with ``EPERM`` to a client holding the descriptor and to a process that finds it
under ``/proc/<daemon>/fd``, and the daemon serves on with every block's bytes intact."""

from __future__ import annotations

import array
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from daemonlib import (
    HEADER_SIZE, LAYOUT, Daemon, block_for, cleanup, dev_shm, empty_blocks, keys_for, maps_arena, raw_login, raw_stats, raw_unix,
    cleanup, recv_exactly, short_tmpdir, start_daemon, write_config,
)
from kvstore.daemon.wire import messages as m
from kvstore.daemon.client.connection import DaemonClient, DaemonUnavailable
from kvstore.daemon.wire.frames import ARENA_BYTE, REPLY_BIT, DaemonError, ErrorCode, Op, encode_frame


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


def _hostile_daemon(path: str, send_arena) -> tuple[socket.socket, threading.Thread]:  # noqa: ANN001
    """A server on ``path`` that answers a HELLO granting shared memory, then calls ``send_arena(conn)``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                head = recv_exactly(conn, HEADER_SIZE)
                if head is None:
                    continue
                rid = int.from_bytes(head[8:12], "little")
                recv_exactly(conn, int.from_bytes(head[12:16], "little"))
                reply = m.encode_hello_reply(m.HelloReply(None, "kvstore-fake", LAYOUT.bytes_per_block, 4, 2.0,
                                                          1 << 20, 64))
                conn.sendall(encode_frame(Op.HELLO | REPLY_BIT, rid, reply))
                send_arena(conn)
                try:
                    conn.recv(1)  # until the client hangs up
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def _links_to(fd: str, target: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(target)
    except OSError:
        return False


def _send_fd(conn: socket.socket, fd: int) -> None:
    conn.sendmsg([ARENA_BYTE], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


@pytest.mark.parametrize("what", ["no descriptor", "unsealed memfd", "too small"])
def test_a_client_never_maps_an_arena_another_process_could_shrink(what: str) -> None:
    """The client side of the hand-off, against a daemon that sends the wrong thing: a byte without a descriptor,
    a memfd without the shrink seal (its sender could truncate it under the client: SIGBUS at the next copy),
    or one too small for the slots it announced. Each is refused naming why, nothing is mapped, and the
    connection is dropped (no socket or descriptor kept)."""
    root = short_tmpdir()
    path = str(root / "hostile.sock")
    memfd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
    os.ftruncate(memfd, (4 if what != "too small" else 1) * LAYOUT.bytes_per_block)
    if what == "too small":
        import fcntl
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    sender = (lambda conn: conn.sendall(ARENA_BYTE)) if what == "no descriptor" else (lambda conn: _send_fd(conn, memfd))
    server, thread = _hostile_daemon(path, sender)
    client = DaemonClient(LAYOUT, socket_path=path)
    try:
        if what == "no descriptor":
            with pytest.raises(DaemonUnavailable, match="expected the arena's descriptor after the reply"):
                client.connect(5.0)
        else:
            with pytest.raises(DaemonError) as info:
                client.connect(5.0)
            assert info.value.code == ErrorCode.BAD_FRAME
            assert "passed an unusable shared arena" in str(info.value)
            assert ("not sealed against shrinking" if what == "unsealed memfd" else "too few for 4 slots") in str(info.value)
        assert client.arena is None and client._sock is None  # noqa: SLF001 - nothing kept
        held = [fd for fd in os.listdir("/proc/self/fd") if _links_to(fd, "/memfd:hostile")]
        assert held == [str(memfd)], held  # the client kept no descriptor of the arena it refused
    finally:
        client.close()
        server.close()
        os.close(memfd)
        thread.join(5)
        cleanup(None, root)
