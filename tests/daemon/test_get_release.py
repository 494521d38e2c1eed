"""GET_SHM_RELEASE (protocol 4): a get whose frame first ends the holds of the previous get, against a live daemon.

A client's get defers its release; the next get carries it (one frame, one wake-up of the daemon for both).
Hostile frames are refused with an error naming the message and what is wrong, before any hold is ended,
and the connection stays in step (or, before login, is closed). A peer on another protocol version is
refused at its first frame, and a client facing such a daemon gets a refusal, not retries.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from daemonlib import (
    LAYOUT, Daemon, block_for, cleanup, empty_blocks, expect_error, keys_for, raw_login, raw_unix, read_reply,
    recv_exactly, short_tmpdir, start_daemon, write_config,
)
from kvstore.daemon.wire import messages as m
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.wire.frames import HEADER, HEADER_SIZE, MAGIC, PROTOCOL_VERSION, REPLY_BIT, DaemonError, ErrorCode, Op, encode_frame

MAX_KEYS_PER_REQUEST = 8


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root, daemon={"max_keys_per_request": MAX_KEYS_PER_REQUEST}))
        yield d
    finally:
        cleanup(d, root)


def _ask(s: socket.socket, op: Op, payload: bytes, rid: int = 7) -> tuple[int, bytes]:
    s.sendall(encode_frame(op, rid, payload))
    reply = read_reply(s)
    assert reply is not None
    return reply


def _refused(s: socket.socket, payload: bytes, code: ErrorCode) -> str:
    op, body = _ask(s, Op.GET_SHM_RELEASE, payload)
    assert op == Op.ERROR, (op, body)
    got, message = m.decode_error(body)
    assert got == code, message
    return message


def _holds(s: socket.socket) -> int:
    op, body = _ask(s, Op.STATS, b"")
    assert op == Op.STATS | REPLY_BIT  # the next frame is this reply: the connection is in step
    return int(json.loads(body)["holds"])


@pytest.fixture
def held(daemon: Daemon) -> Iterator[tuple[socket.socket, list[bytes]]]:
    """A raw shm connection holding read holds on two stored keys (one GET_SHM)."""
    tier = daemon.tier(read_directory=False)  # the held path: GET_SHM, copy, release
    keys = keys_for(2, seed=61)
    assert tier.put(keys, [block_for(k) for k in keys]) == [True, True]
    tier.close()
    with raw_unix(daemon) as s:
        raw_login(s)
        op, body = _ask(s, Op.GET_SHM, m.encode_keys(keys))
        assert op == Op.GET_SHM | REPLY_BIT and [st for st, _ in m.decode_slots(body, Op.GET_SHM)] == [1, 1]
        yield s, keys
        _ask(s, Op.RELEASE, m.encode_keys(keys))  # holds counts are daemon-wide: leave none to the next test
        assert _holds(s) == 0


def test_a_get_carries_the_previous_gets_release(daemon: Daemon) -> None:
    tier = daemon.tier(read_directory=False)  # the held path: GET_SHM, copy, release
    try:
        keys = keys_for(4, seed=60)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 4
        before = tier.client.stats()["daemon"]["requests"]
        dests = empty_blocks(4)
        with tier.client.lock:  # the flusher cannot send a deferred release on its own meanwhile
            for _ in range(3):
                assert tier.get(keys, dests) == [True] * 4
                assert all(bool((d == block_for(k)).all()) for k, d in zip(keys, dests))
        after = tier.client.stats()  # carries the third get's release, as a RELEASE_QUIET ahead of it
        assert after["holds"] == 0
        reqs = after["daemon"]["requests"]
        assert reqs.get("GET_SHM", 0) - before.get("GET_SHM", 0) == 1  # only the first get had nothing to carry
        assert reqs.get("GET_SHM_RELEASE", 0) - before.get("GET_SHM_RELEASE", 0) == 2
        assert reqs.get("RELEASE_QUIET", 0) - before.get("RELEASE_QUIET", 0) == 1
    finally:
        tier.close()


def test_it_releases_then_gets_in_one_frame(held: tuple[socket.socket, list[bytes]]) -> None:
    s, keys = held
    assert _holds(s) == 2
    op, body = _ask(s, Op.GET_SHM_RELEASE, m.encode_get_release(keys, keys[:1]))
    assert op == Op.GET_SHM_RELEASE | REPLY_BIT and [st for st, _ in m.decode_slots(body, Op.GET_SHM)] == [1]
    assert _holds(s) == 1  # two ended, one taken
    op, body = _ask(s, Op.GET_SHM_RELEASE, m.encode_get_release(keys[:1], []))  # release only
    assert op == Op.GET_SHM_RELEASE | REPLY_BIT and m.decode_slots(body, Op.GET_SHM) == []
    assert _holds(s) == 0
    op, _ = _ask(s, Op.GET_SHM_RELEASE, m.encode_get_release(keys, []))  # keys it no longer holds: nothing to end
    assert op == Op.GET_SHM_RELEASE | REPLY_BIT and _holds(s) == 0


@pytest.mark.parametrize("case", ["empty", "release overruns", "no get count", "get count wrong", "trailing bytes"])
def test_a_malformed_frame_is_named_and_ends_no_hold(held: tuple[socket.socket, list[bytes]], case: str) -> None:
    s, keys = held
    release = m.encode_keys(keys)
    payload = {
        "empty": b"",
        "release overruns": struct.pack("<I", 5) + b"".join(keys),  # says 5 keys, carries 2
        "no get count": release,
        "get count wrong": release + struct.pack("<I", 3) + keys[0],
        "trailing bytes": release + m.encode_keys(keys[:1]) + b"x",
    }[case]
    message = _refused(s, payload, ErrorCode.BAD_FRAME)
    assert message.startswith("GET_SHM_RELEASE: "), message
    assert _holds(s) == 2  # refused before the release part ran; the connection goes on


def test_over_the_key_limits_is_refused_and_ends_no_hold(held: tuple[socket.socket, list[bytes]]) -> None:
    s, keys = held
    many = keys_for(MAX_KEYS_PER_REQUEST + 1, seed=62)
    assert _refused(s, m.encode_get_release(keys + many, []), ErrorCode.TOO_LARGE) == (
        f"GET_SHM_RELEASE: {len(keys) + len(many)} keys to release, limit is {MAX_KEYS_PER_REQUEST} "
        "(daemon.max_keys_per_request)")
    assert _refused(s, m.encode_get_release(keys, many), ErrorCode.TOO_LARGE) == (
        f"GET_SHM_RELEASE: {len(many)} keys, limit is {MAX_KEYS_PER_REQUEST} (daemon.max_keys_per_request)")
    huge = struct.pack("<I", 16385) + b"".join(keys)  # over the protocol's bound: refused before any slicing
    assert _refused(s, huge, ErrorCode.TOO_LARGE) == "GET_SHM_RELEASE: 16385 keys to release, limit is 16384"
    assert _holds(s) == 2


def test_before_login_it_is_refused_and_the_connection_closed(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        s.sendall(encode_frame(Op.GET_SHM_RELEASE, 1, m.encode_get_release([], keys_for(1, seed=63))))
        assert "GET_SHM_RELEASE before HELLO" in expect_error(s, ErrorCode.UNAUTHORIZED, closed=True)


def test_without_shared_memory_it_is_not_allowed(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        raw_login(s, want_shm=False)
        message = _refused(s, m.encode_get_release([], keys_for(1, seed=64)), ErrorCode.NOT_ALLOWED)
        assert message.startswith("GET_SHM_RELEASE: shared memory is only for"), message
        assert _holds(s) == 0


def test_a_peer_on_the_previous_protocol_is_refused_by_version(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        hello = m.encode_hello(m.Hello(LAYOUT.fingerprint, None, "old", True))
        s.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION - 1, Op.HELLO, 1, len(hello)) + hello)
        message = expect_error(s, ErrorCode.BAD_VERSION, closed=True)
        assert f"uses protocol version {PROTOCOL_VERSION - 1}; this side speaks {PROTOCOL_VERSION}" in message


def test_a_client_facing_a_daemon_on_another_version_gets_a_refusal_not_retries() -> None:
    root = short_tmpdir()
    path = str(root / "old.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    accepted: list[int] = []

    def old_daemon() -> None:  # answers every connection's first frame as a protocol-3 daemon would
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                accepted.append(1)
                recv_exactly(conn, HEADER_SIZE)
                body = m.encode_error(ErrorCode.BAD_VERSION, "HELLO uses protocol version 4; this side speaks 3")
                conn.sendall(HEADER.pack(MAGIC, 3, Op.ERROR, 1, len(body)) + body)

    thread = threading.Thread(target=old_daemon, daemon=True)
    thread.start()
    client = DaemonClient(LAYOUT, socket_path=path)
    try:
        t0 = time.monotonic()
        with pytest.raises(DaemonError) as info:
            client.connect(wait_s=5.0)
        assert info.value.code == ErrorCode.BAD_VERSION
        assert "speaks another protocol" in str(info.value) and f"uses protocol version 3; this side speaks {PROTOCOL_VERSION}" in str(info.value)
        assert time.monotonic() - t0 < 2.0 and len(accepted) == 1  # refused at once: no reconnect loop
    finally:
        client.close()
        server.close()
        thread.join(5)
        cleanup(None, root)
