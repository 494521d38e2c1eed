"""The holds of a client process that died end at once, not at the hold deadline;
a client that is alive with its connection closed keeps the slots it reserved (quarantined: it may still
copy into them) until it exits."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from daemonlib import observer_stats, LAYOUT, REPO, Daemon, block_for, cleanup, keys_for, short_tmpdir, start_daemon, write_config
from kvstore.daemon.wire import messages as m
from kvstore.daemon.server.admission import peer_of
from kvstore.daemon.wire.frames import HEADER_SIZE, Op, encode_frame
from kvstore.daemon.server.peer import PeerProcess

HOLDER = """
import socket, struct, sys
def reply(s):
    head = s.recv(16, socket.MSG_WAITALL)
    return head + s.recv(struct.unpack_from("<I", head, 12)[0], socket.MSG_WAITALL)
s = socket.socket(socket.AF_UNIX)
s.connect({sock!r})
s.sendall(bytes.fromhex({hello!r}))
reply(s)
socket.recv_fds(s, 1, 1)  # the arena's descriptor (kept open: the process holds the arena as a client does)
s.sendall(bytes.fromhex({reserve!r}))
print(reply(s).hex(), flush=True)
if {close!r}:
    s.close()
    print("closed", flush=True)
sys.stdin.readline()
"""
"""A client process that reserves as many host slots as one connection may (plain sockets: starts fast, imports
nothing of kvstore)."""
SHARE = 32
"""What one connection may reserve of the 64 host slots: half (``RESERVE_SHARE``); it asks for all 64."""
HOLD_TIMEOUT_S = 60.0
"""Long, so a put that succeeds within seconds proves the holds did not just expire."""


def _holder(daemon: Daemon, close: bool) -> subprocess.Popen[str]:
    hello = encode_frame(Op.HELLO, 1, m.encode_hello(m.Hello(LAYOUT.fingerprint, None, "holder", True)))
    reserve = encode_frame(Op.PUT_SHM_RESERVE, 2, m.encode_keys(keys_for(64, seed=99)))
    code = HOLDER.format(sock=daemon.socket_path, hello=hello.hex(), reserve=reserve.hex(), close=close)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    states = m.decode_slots(bytes.fromhex(proc.stdout.readline().strip())[HEADER_SIZE:], Op.PUT_SHM_RESERVE)
    assert [st for st, _ in states] == [m.PutState.RESERVED] * SHARE + [m.PutState.BUSY] * (64 - SHARE)
    if close:
        assert proc.stdout.readline().strip() == "closed"
    return proc


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root, daemon={"hold_timeout_s": HOLD_TIMEOUT_S}))
        yield d
    finally:
        cleanup(d, root)


def _put_until_stored(daemon: Daemon, seed: int, within_s: float) -> float:
    """Seconds until a fresh client's put of new blocks is stored (raises if not within ``within_s``)."""
    tier = daemon.tier(client_name="next")
    keys = keys_for(4, seed=seed)
    t0 = time.monotonic()
    try:
        while not all(tier.put(keys, [block_for(k) for k in keys])):
            assert time.monotonic() - t0 < within_s, f"put still refused after {within_s} s: {observer_stats(daemon)}"
            time.sleep(0.05)
        return time.monotonic() - t0
    finally:
        tier.client.close()


def test_kill9_of_a_client_frees_its_slots_at_once(daemon: Daemon) -> None:
    holder = None
    base = observer_stats(daemon)["counters"]["owner_releases"]
    try:
        holder = _holder(daemon, close=False)
        assert observer_stats(daemon)["holds"] == SHARE
        holder.kill()
        holder.wait()
        deadline = time.monotonic() + 10.0  # the holds' deadline was 60 s away
        while observer_stats(daemon)["holds"]:
            assert time.monotonic() < deadline, f"holds of a killed client kept: {observer_stats(daemon)}"
            time.sleep(0.05)
        assert _put_until_stored(daemon, seed=7, within_s=10.0) < 10.0
        stats = observer_stats(daemon)
        assert stats["holds_expired"] == 0 and stats["counters"]["owner_releases"] - base == SHARE
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()


def test_a_live_client_keeps_its_holds_until_it_exits(daemon: Daemon) -> None:
    holder = None
    base = observer_stats(daemon)["counters"]["owner_releases"]
    try:
        holder = _holder(daemon, close=True)  # connection closed, process alive: it may still copy
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            stats = observer_stats(daemon)
            assert stats["holds"] + stats["quarantined_slots"] == SHARE, "slots of a live writer were reused"
            time.sleep(0.1)
        assert holder.stdin is not None
        holder.stdin.write("exit\n")
        holder.stdin.flush()
        holder.wait(10)
        deadline = time.monotonic() + 10.0
        while observer_stats(daemon)["counters"]["owner_releases"] - base < SHARE:
            assert time.monotonic() < deadline, f"slots of an exited client kept: {observer_stats(daemon)}"
            time.sleep(0.05)
        assert _put_until_stored(daemon, seed=17, within_s=10.0) < 10.0
        assert observer_stats(daemon)["counters"]["owner_releases"] - base == SHARE
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()


class _Writer:
    """What :func:`peer_of` reads of an accepted connection's StreamWriter."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def get_extra_info(self, name: str) -> object:
        return self.sock if name == "socket" else None


def test_peer_process_tells_exited_from_alive() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    unix = peer_of(_Writer(a), "unix")  # the one SO_PEERCRED read the daemon makes at accept
    me = PeerProcess.of_peer(unix.pid)
    assert me is not None and me.pid == os.getpid() and not me.gone()
    assert unix.ident == f"uid:{os.getuid()}"
    me.close()
    a.close()
    b.close()
    assert PeerProcess.of_peer(None) is None  # TCP: no peer process, deadline only
    assert PeerProcess.of_peer(0) is None  # a pid from another pid namespace
    for use_pidfd in (True, False):
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
        peer = PeerProcess(child.pid)
        if not use_pidfd:
            peer.close()  # the /proc start-time fallback
        assert not peer.gone()
        assert asyncio.run(peer.wait_gone(0.2)) is False
        child.send_signal(signal.SIGKILL)
        assert asyncio.run(peer.wait_gone(10)) is True  # a zombie (not reaped yet) counts as gone
        child.wait()
        assert peer.gone()
        peer.close()
