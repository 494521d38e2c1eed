"""Bounds a hostile client cannot push the daemon past.

Item 8: a request is bounded by ``daemon.max_keys_per_request`` and a
GET_INLINE by the reply it could need; repeated keys are read once. Item 9:
before login a frame may carry 4 KiB; a connection that does not log in, or
goes silent, is closed; connections are capped per peer and in all with room
kept for local clients; what a peer can repeat is logged once per interval.
"""

from __future__ import annotations

import errno
import logging
import struct
import time
from collections.abc import Iterator

import pytest
import torch

from daemonlib import (
    LAYOUT, Daemon, block_for, cleanup, expect_error, free_port, keys_for, raw_login, raw_tcp, raw_unix, read_reply, short_tmpdir,
    start_daemon, write_config,
)
from kvstore.config import load_config
from kvstore.daemon.wire import messages as m
from kvstore.daemon.wire.frames import HEADER, MAGIC, PROTOCOL_VERSION, ErrorCode, Op, encode_frame
from kvstore.daemon.server.daemon import DaemonServer
from kvstore.daemon.server.session import QUIET_OPS

BPB = LAYOUT.bytes_per_block  # 512
MAX_FRAME = 1 << 20
MAX_KEYS = 4096


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        cfg = write_config(root, daemon={"tcp_host": "127.0.0.1", "tcp_port": free_port(), "token": "t0k",
                                         "max_frame_bytes": MAX_FRAME, "max_keys_per_request": MAX_KEYS,
                                         "login_timeout_s": 1.0})
        d = start_daemon(cfg)
        yield d
    finally:
        cleanup(d, root)


def login(s, want_shm: bool = False) -> None:  # noqa: ANN001 - a socket
    raw_login(s, want_shm)


def ask(s, op: Op, payload: bytes) -> tuple[int, bytes]:  # noqa: ANN001 - a socket
    s.sendall(encode_frame(op, 7, payload))
    reply = read_reply(s)
    assert reply is not None
    return reply


# ------------------------------------------------------------------ item 8
def test_a_repeated_key_is_refused_and_the_reply_is_bounded(daemon: Daemon) -> None:
    """A GET_INLINE reply repeats the block for every mention of its key: a request naming one key 2,000
    times (64 KiB) asked for a 1 MB reply, 2,047x at 64 KiB blocks. Repeats are refused before any work;
    distinct keys are bounded by the frame limit; the connection goes on either way."""
    tier = daemon.tier(token=None)
    key = keys_for(1, seed=801)
    assert tier.put(key, [block_for(key[0])]) == [True]
    with raw_unix(daemon) as s:
        login(s)
        hits = tier.client.stats()["counters"]["host_hits"]
        op, body = ask(s, Op.GET_INLINE, m.encode_keys(key * 2000))
        assert op == Op.ERROR
        assert m.decode_error(body) == (ErrorCode.NOT_ALLOWED, f"GET_INLINE: key {key[0].hex()[:16]}… is named 2000 "
                                        "times in one request of 2000 keys; name each key once")
        assert tier.client.stats()["counters"]["host_hits"] == hits  # refused before any work
        many = keys_for(2100, seed=803)
        op, body = ask(s, Op.GET_INLINE, m.encode_keys(many))  # could need 1,077,304 bytes
        assert op == Op.ERROR
        code, message = m.decode_error(body)
        assert code == ErrorCode.TOO_LARGE
        assert message == (f"GET_INLINE: 2100 keys need a reply of up to {4 + 2100 * (BPB + 1)} bytes, "
                           f"limit is {MAX_FRAME} (daemon.max_frame_bytes)")
        op, body = ask(s, Op.GET_INLINE, m.encode_keys(key + many[:100]))  # distinct keys: served
        assert op == Op.GET_INLINE | 0x8000
        assert m.decode_blocks(body, BPB)[0] == block_for(key[0]).numpy().tobytes()
    got = [torch.empty_like(block_for(key[0])) for _ in range(3)]
    assert tier.get(key * 3, got) == [True] * 3  # the client library asks for a repeated key once
    assert all(torch.equal(g, block_for(key[0])) for g in got)
    tier.close()


@pytest.mark.parametrize("op", sorted(m.KEY_OPS - QUIET_OPS))  # never answered: test_release_quiet.py, test_slot_directory_daemon.py
def test_every_keys_request_is_bounded_by_max_keys_per_request(daemon: Daemon, op: Op) -> None:
    with raw_unix(daemon) as s:
        login(s, want_shm=True)
        reply = ask(s, op, m.encode_keys(keys_for(MAX_KEYS + 1, seed=802)))
        assert reply[0] == Op.ERROR
        assert m.decode_error(reply[1]) == (
            ErrorCode.TOO_LARGE, f"{op.name}: {MAX_KEYS + 1} keys, limit is {MAX_KEYS} (daemon.max_keys_per_request)")
        assert ask(s, Op.STATS, b"")[0] == Op.STATS | 0x8000  # not fatal


def test_put_inline_over_the_key_limit_is_refused() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root, daemon={"max_keys_per_request": 4}))
        with raw_unix(d) as s:
            login(s)
            keys = keys_for(5, seed=803)
            reply = ask(s, Op.PUT_INLINE, m.encode_put_inline(keys, [bytes(BPB)] * 5))
            assert reply[0] == Op.ERROR
            assert m.decode_error(reply[1]) == (
                ErrorCode.TOO_LARGE, "PUT_INLINE: 5 keys, limit is 4 (daemon.max_keys_per_request)")
        tier = d.tier()  # the client splits its batches by the limit the daemon announced
        keys = keys_for(30, seed=804)
        assert tier.client.max_keys == 4
        assert all(tier.put(keys, [block_for(k) for k in keys])) and tier.contains_prefix(keys) == 30
        assert tier.delete(keys) == 30
        tier.close()
    finally:
        cleanup(d, root)


# ------------------------------------------------------------------ item 9
def test_prelogin_frames_are_bounded_to_a_login(daemon: Daemon) -> None:
    t0 = time.monotonic()
    for connect in (raw_unix, raw_tcp):
        with connect(daemon) as s:  # 60 MiB announced, nothing sent: refused from the header alone
            s.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.PUT_INLINE, 1, 60 << 20))
            message = expect_error(s, ErrorCode.TOO_LARGE, closed=True)
            assert message == f"PUT_INLINE frame announces {60 << 20} payload bytes, limit is 4096 before login"
        with connect(daemon) as s:  # 8 KiB is fine after login (limit 1 MiB) but not before it
            s.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.HELLO, 1, 8192))
            expect_error(s, ErrorCode.TOO_LARGE, closed=True)
    assert time.monotonic() - t0 < 5.0


def test_connection_that_does_not_log_in_is_closed(daemon: Daemon) -> None:
    for partial in (b"", HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.HELLO, 1, 40)[:7]):  # idle, and half a header
        with raw_tcp(daemon) as s:
            t0 = time.monotonic()
            s.sendall(partial)
            assert read_reply(s) is None  # closed by the daemon (the socket's own timeout is 10 s)
            assert 0.9 < time.monotonic() - t0 < 5.0
    with raw_unix(daemon) as s:  # a login that started but never finished
        s.sendall(encode_frame(Op.CHALLENGE, 1))
        assert read_reply(s) is not None
        assert read_reply(s) is None


@pytest.fixture()
def capped() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root, daemon={
            "tcp_host": "127.0.0.1", "tcp_port": free_port(), "token": "t0k", "max_connections": 8,
            "max_connections_per_peer": 4, "idle_timeout_s": 1.0}))
        yield d
    finally:
        cleanup(d, root)


def refused(s) -> str:  # noqa: ANN001 - a socket
    return expect_error(s, ErrorCode.UNAVAILABLE, closed=True)


def test_connection_caps_leave_room_for_local_clients(capped: Daemon) -> None:
    d = capped
    held = [raw_tcp(d, "127.0.0.1") for _ in range(4)]
    with raw_tcp(d, "127.0.0.1") as s:
        assert "peer tcp:127.0.0.1 has 4 connections, its limit (daemon.max_connections_per_peer)" in refused(s)
    held += [raw_tcp(d, "127.0.0.2") for _ in range(3)]
    with raw_tcp(d, "127.0.0.3") as s:  # 7 TCP connections of 8: the last is kept for local clients
        assert "7 TCP connections, the most TCP may use of daemon.max_connections 8" in refused(s)
    local = d.tier(client_name="local engine")  # a legitimate local client still connects
    key = keys_for(1, seed=901)
    assert local.put(key, [block_for(key[0])]) == [True]
    with raw_unix(d) as s:
        assert "the daemon has 8 connections, its limit (daemon.max_connections)" in refused(s)
    for s in held:
        s.close()
    deadline = time.monotonic() + 5  # the daemon sees the closes asynchronously: poll until one is admitted
    while True:
        with raw_tcp(d, "127.0.0.3") as s:
            s.sendall(encode_frame(Op.CHALLENGE, 1))
            reply = read_reply(s)
        if reply is not None and reply[0] == Op.CHALLENGE | 0x8000:
            break
        assert time.monotonic() < deadline, "closed connections were never forgotten"
        time.sleep(0.05)
    assert local.client.stats()["daemon"]["connections_refused"] >= 3
    local.close()
    text = d.log.read_text()  # three refusals, one line per topic and interval
    assert text.count("refused a tcp connection") == 1 and text.count("refused a unix connection") == 1


def test_idle_logged_in_connection_is_closed_and_the_client_reconnects(capped: Daemon) -> None:
    with raw_unix(capped) as s:
        login(s)
        t0 = time.monotonic()
        assert read_reply(s) is None
        assert 0.9 < time.monotonic() - t0 < 5.0
    tier = capped.tier()
    generation = tier.client.generation
    time.sleep(2.0)  # past the daemon's 1 s idle timeout: it has closed this connection
    key = keys_for(1, seed=902)
    assert tier.put(key, [block_for(key[0])]) == [True]  # reconnected transparently, nothing lost
    assert tier.client.generation == generation + 1
    tier.close()


def test_repeated_errors_are_logged_once_per_interval(capped: Daemon) -> None:
    for _ in range(20):
        with raw_unix(capped) as s:
            s.sendall(b"JUNK" + bytes(12))
            expect_error(s, ErrorCode.BAD_FRAME, closed=True)
    tier = capped.tier()
    tier.client.stats()  # every refusal above was handled before this answer
    tier.close()
    assert capped.log.read_text().count("bad magic") == 1


def test_accept_errors_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture, tmp_path) -> None:  # noqa: ANN001
    server = DaemonServer(load_config(write_config(tmp_path)))
    emfile = OSError(errno.EMFILE, "Too many open files")
    with caplog.at_level(logging.WARNING, logger="kvstore.daemon.server.daemon"):
        for _ in range(500):
            server._loop_error(None, {"message": "socket.accept() out of system resource", "exception": emfile})  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["event loop: socket.accept() out of system resource: [Errno 24] Too many open files"]
    server._executor.shutdown()
