"""Hostile and broken clients against a live daemon: each gets an error or a closed connection, others go on."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemonlib import (
    LAYOUT, Daemon, block_for, cleanup, empty_blocks, expect_error, free_port, keys_for, raw_tcp, raw_unix, read_reply, short_tmpdir,
    start_daemon, write_config,
)
from kvstore.daemon.wire import messages as m
from kvstore.daemon.wire.auth import login_proof
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.wire.frames import HEADER, MAGIC, PROTOCOL_VERSION, ErrorCode, Op, encode_frame
from kvstore.daemon.server.session import QUIET_OPS
from kvstore.daemon.client.tier import DaemonTier

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        cfg = write_config(root, daemon={"tcp_host": "127.0.0.1", "tcp_port": free_port(), "token": TOKEN,
                                         "max_frame_bytes": 65536})
        d = start_daemon(cfg)
        yield d
    finally:
        cleanup(d, root)


def handshake(s: socket.socket) -> None:
    s.sendall(encode_frame(Op.HELLO, 1, m.encode_hello(m.Hello(LAYOUT.fingerprint, None, "raw", False))))
    reply = read_reply(s)
    assert reply is not None and reply[0] == Op.HELLO | 0x8000


def still_serves(d: Daemon) -> None:
    """A well-behaved client round-trips a block, and the daemon process is alive."""
    assert d.proc.poll() is None
    tier = d.tier(client_name="good")
    key = keys_for(1, seed=99)
    assert tier.put(key, [block_for(key[0])]) == [True]
    dest = empty_blocks(1)
    assert tier.get(key, dest) == [True] and torch.equal(dest[0], block_for(key[0]))
    tier.close()


def test_bad_magic_is_refused_and_closed(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        s.sendall(b"HTTP" + encode_frame(Op.STATS, 1)[4:])
        expect_error(s, ErrorCode.BAD_FRAME, closed=True)
    still_serves(daemon)


def test_wrong_protocol_version(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        s.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, Op.HELLO, 1, 0))
        expect_error(s, ErrorCode.BAD_VERSION, closed=True)
    still_serves(daemon)


def test_oversized_length_refused_before_payload(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        s.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.PUT_INLINE, 1, 0xFFFFFFFF))  # no payload follows
        expect_error(s, ErrorCode.TOO_LARGE, closed=True)
    still_serves(daemon)


def test_request_before_handshake(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        s.sendall(encode_frame(Op.GET_INLINE, 1, m.encode_keys(keys_for(1, seed=99))))
        expect_error(s, ErrorCode.UNAUTHORIZED, closed=True)


def test_unknown_op_and_bad_payload_keep_the_connection(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        handshake(s)
        s.sendall(encode_frame(0x0123, 2, b"whatever"))
        reply = read_reply(s)
        assert reply is not None and reply[0] == Op.ERROR and m.decode_error(reply[1])[0] == ErrorCode.UNKNOWN_OP
        s.sendall(encode_frame(Op.EXISTS_PREFIX, 3, struct.pack("<I", 3) + b"k" * 32))
        reply = read_reply(s)
        assert reply is not None and m.decode_error(reply[1])[0] == ErrorCode.BAD_FRAME
        s.sendall(encode_frame(Op.GET_SHM, 4, m.encode_keys(keys_for(1))))  # shm not asked for at HELLO
        reply = read_reply(s)
        assert reply is not None and m.decode_error(reply[1])[0] == ErrorCode.NOT_ALLOWED
        s.sendall(encode_frame(Op.STATS, 5))  # the same connection still works
        reply = read_reply(s)
        assert reply is not None and reply[0] == Op.STATS | 0x8000 and m.decode_json(reply[1])["daemon"]
    still_serves(daemon)


def test_client_vanishing_mid_request(daemon: Daemon) -> None:
    for partial in (encode_frame(Op.STATS, 1)[:7], HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.PUT_INLINE, 1, 1000) + b"x" * 10):
        s = raw_unix(daemon)
        handshake(s)
        s.sendall(partial)
        s.close()
    still_serves(daemon)


def test_tcp_without_token_gets_nothing(daemon: Daemon) -> None:
    key = keys_for(1, seed=99)
    still_serves(daemon)  # the block exists, so a leak would show
    with raw_tcp(daemon) as s:
        s.sendall(encode_frame(Op.GET_INLINE, 1, m.encode_keys(key)))
        expect_error(s, ErrorCode.UNAUTHORIZED, closed=True)
    with raw_tcp(daemon) as s:  # no token at all
        s.sendall(encode_frame(Op.HELLO, 1, m.encode_hello(m.Hello(LAYOUT.fingerprint, None, "intruder", True))))
        expect_error(s, ErrorCode.UNAUTHORIZED, closed=True)
    with raw_tcp(daemon) as s:  # a wrong token's proof
        s.sendall(encode_frame(Op.CHALLENGE, 1))
        reply = read_reply(s)
        assert reply is not None and reply[0] == Op.CHALLENGE | 0x8000
        proof = login_proof("wrong", reply[1], "tcp", LAYOUT.fingerprint, True, "intruder")
        s.sendall(encode_frame(Op.HELLO, 2, m.encode_hello(m.Hello(LAYOUT.fingerprint, proof, "intruder", True))))
        expect_error(s, ErrorCode.UNAUTHORIZED, closed=True)


def test_tcp_with_token_moves_bytes_inline(daemon: Daemon) -> None:
    assert daemon.tcp is not None
    host, port = daemon.tcp.rsplit(":", 1)
    client = DaemonClient(LAYOUT, tcp=(host, int(port)), token=TOKEN, client_name="remote")
    hello = client.connect(10)
    assert hello.shm_name is None  # remote clients never get shared memory
    tier = DaemonTier(LAYOUT, client)
    keys = keys_for(300, seed=7)  # more than one 64 KiB frame: the tier splits batches
    assert all(tier.put(keys, [block_for(k) for k in keys]))
    tier.flush()  # on disk: host slots holding blocks not yet written cannot take the disk hits back
    dests = empty_blocks(300)
    assert all(tier.get(keys, dests))
    assert all(torch.equal(d, block_for(k)) for k, d in zip(keys, dests))
    tier.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op=st.integers(0, 0x8100), payload=st.binary(max_size=300))
def test_fuzz_live_frames(daemon: Daemon, op: int, payload: bytes) -> None:
    with raw_unix(daemon) as s:
        handshake(s)
        s.sendall(encode_frame(op, 9, payload))
        if op in QUIET_OPS:  # never answered, not even with an error (its client reads no reply): the next one is
            s.sendall(encode_frame(Op.STATS, 10, b""))
        reply = read_reply(s)
        assert reply is not None  # a well-framed request always gets an answer
        if op in QUIET_OPS:
            assert reply[0] in (Op.STATS | 0x8000, Op.ERROR)  # an error only if the quiet one was fatal
    assert daemon.proc.poll() is None


def test_still_serving_after_fuzz(daemon: Daemon) -> None:
    still_serves(daemon)


def test_a_malformed_exists_chain_is_an_error_naming_the_field_and_the_connection_goes_on(daemon: Daemon) -> None:
    keys = keys_for(3, seed=98)
    with raw_unix(daemon) as s:
        handshake(s)
        for rid, payload, why in ((2, b"\x01\x00", "has no start position"),
                                  (3, m.encode_chain(keys, 0)[:-5], "entries need"),
                                  (4, struct.pack("<I", 4) + m.encode_keys(keys), "start position 4 is past the chain's 3 keys")):
            s.sendall(encode_frame(Op.EXISTS_CHAIN, rid, payload))
            reply = read_reply(s)
            assert reply is not None and reply[0] == Op.ERROR
            code, message = m.decode_error(reply[1])
            assert code == ErrorCode.BAD_FRAME and message.startswith("EXISTS_CHAIN") and why in message, message
        s.sendall(encode_frame(Op.EXISTS_CHAIN, 5, m.encode_chain(keys, 3)))  # start at the end: a well-formed no-op
        reply = read_reply(s)
        assert reply is not None and reply[0] == Op.EXISTS_CHAIN | 0x8000 and m.decode_found(reply[1], Op.EXISTS_CHAIN, 0) == ()
    still_serves(daemon)
