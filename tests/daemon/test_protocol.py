"""The frame parser and message codecs, in process: exact round trips, bounds before allocation, fuzzing."""

from __future__ import annotations

import json
import re
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.daemon.wire import messages as m
from kvstore.daemon.wire.frames import (
    HEADER, HEADER_SIZE, MAGIC, MAX_KEYS, PROTOCOL_VERSION, ErrorCode, Op, ProtocolError, decode_header, encode_frame,
)
from kvstore.daemon.server.holds import Hold, HoldTable
from kvstore.daemon.wire.layout_check import layout_fields
from kvstore.layout import KVLayout

BPB = 512
LIMIT = 1 << 20


def parse(frame: bytes) -> m.Request:
    """What the daemon does with one buffered frame: header checks, then the payload."""
    header = decode_header(frame[:HEADER_SIZE], LIMIT)
    payload = frame[HEADER_SIZE:]
    if len(payload) != header.length:
        raise ProtocolError(ErrorCode.BAD_FRAME, "short payload")
    return m.decode_request(header.op, payload, BPB)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    try:
        parse(data)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None)
@given(op=st.integers(0, 0xFFFF), rid=st.integers(0, 2**32 - 1), payload=st.binary(max_size=600))
def test_fuzz_valid_header_any_payload(op: int, rid: int, payload: bytes) -> None:
    frame = encode_frame(op, rid, payload)
    try:
        msg = parse(frame)
    except ProtocolError as exc:
        assert not exc.fatal  # the header was fine: the connection may go on
        assert exc.code in (ErrorCode.BAD_FRAME, ErrorCode.UNKNOWN_OP, ErrorCode.TOO_LARGE)
    else:
        assert op in Op._value2member_map_ and op != Op.ERROR
        if isinstance(msg, m.KeysRequest):
            assert all(len(k) == 32 for k in msg.keys)


@given(keys=st.lists(st.binary(min_size=32, max_size=32), max_size=50), op=st.sampled_from(sorted(m.KEY_OPS)))
def test_keys_round_trip(keys: list[bytes], op: Op) -> None:
    msg = parse(encode_frame(op, 7, m.encode_keys(keys)))
    assert msg == m.KeysRequest(op, tuple(keys))


def test_put_inline_round_trip_and_exact_length() -> None:
    keys = [bytes([i]) * 32 for i in range(3)]
    blocks = [bytes([i]) * BPB for i in range(3)]
    msg = parse(encode_frame(Op.PUT_INLINE, 1, m.encode_put_inline(keys, blocks)))
    assert isinstance(msg, m.PutInline)
    assert msg.keys == tuple(keys) and [bytes(b) for b in msg.blocks] == blocks
    with pytest.raises(ProtocolError, match="PUT_INLINE: 3 entries need"):
        parse(encode_frame(Op.PUT_INLINE, 1, m.encode_put_inline(keys, blocks) + b"x"))


def test_hello_carries_the_clients_layout_and_a_hostile_one_is_refused_naming_what_is_wrong() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", model_id="m")
    hello = m.Hello(layout.fingerprint, None, "engine", True, layout)
    assert parse(encode_frame(Op.HELLO, 1, m.encode_hello(hello))) == hello

    def raw(fields: bytes, fingerprint: bytes = layout.fingerprint) -> bytes:
        head = m.encode_hello(m.Hello(fingerprint, None, "x", False))[:-2]  # without the empty layout
        return encode_frame(Op.HELLO, 1, head + struct.pack("<H", len(fields)) + fields)

    good = json.dumps(layout_fields(layout)).encode()
    for payload, says in [
        (b"not json", "HELLO: layout: Expecting value"),
        (b"[1, 2]", "HELLO: layout: a layout is a JSON object, got list"),
        (good.replace(b'"head_dim": 8, ', b""), "HELLO: layout: layout fields: missing ['head_dim']"),
        (good[:-1] + b', "extra": 1}', "HELLO: layout: layout fields: unknown ['extra']"),
        (good.replace(b'"num_layers": 2', b'"num_layers": 0'), "KVLayout.num_layers must be a positive int"),
        (good.replace(b'"num_layers": 2', b'"num_layers": true'), "KVLayout.num_layers must be a positive int"),
        (good.replace(b'"float16"', b'"float64"'), "KVLayout.dtype must be one of"),
        (good.replace(b'"m"', b"7"), "model_id and dtype must be strings"),
        (good.replace(b'"block_size": 4', b'"block_size": 8'), "HELLO: the fingerprint is not its layout's"),
        (b"{" + b" " * 2000 + b"}", "HELLO: layout is 2002 bytes, limit 1024"),
    ]:
        with pytest.raises(ProtocolError, match=re.escape(says)):
            parse(raw(payload))


def test_hello_round_trip_and_reply() -> None:
    hello = m.Hello(b"f" * 16, b"p" * 32, "engine 1", True)
    assert parse(encode_frame(Op.HELLO, 1, m.encode_hello(hello))) == hello
    anonymous = m.Hello(b"f" * 16, None, "", False)
    assert parse(encode_frame(Op.HELLO, 1, m.encode_hello(anonymous))) == anonymous
    with pytest.raises(ProtocolError, match="HELLO: proof is 5 bytes, expected 0 or 32"):
        parse(encode_frame(Op.HELLO, 1, m.encode_hello(m.Hello(b"f" * 16, b"short", "", False))))
    reply = m.HelloReply(b"tenant-a", "kvstore-x", BPB, 64, 2.5, 1 << 20, 512)
    assert m.decode_hello_reply(m.encode_hello_reply(reply)) == reply
    sparse = m.HelloReply(None, "kvstore-y", BPB, 64, 2.5, 1 << 20, 512, sparse=True)
    assert m.decode_hello_reply(m.encode_hello_reply(sparse)) == sparse
    assert m.decode_hello_reply(m.encode_hello_reply(m.HelloReply(None, None, BPB, 1, 1.0, 10, 1))).salt is None
    assert m.decode_challenge(b"n" * 32) == b"n" * 32
    with pytest.raises(ProtocolError, match="CHALLENGE: reply is 3 bytes, expected 32"):
        m.decode_challenge(b"abc")


def test_header_errors_are_fatal_and_named() -> None:
    good = encode_frame(Op.STATS, 1)
    with pytest.raises(ProtocolError, match="bad magic") as bad:
        decode_header(b"XXXX" + good[4:HEADER_SIZE], LIMIT)
    assert bad.value.fatal
    with pytest.raises(ProtocolError, match=f"STATS uses protocol version {PROTOCOL_VERSION + 1}") as ver:
        decode_header(HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, Op.STATS, 1, 0), LIMIT)
    assert ver.value.code == ErrorCode.BAD_VERSION and ver.value.fatal
    with pytest.raises(ProtocolError, match="GET_INLINE frame announces 4294967295 payload bytes") as big:
        decode_header(HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.GET_INLINE, 1, 2**32 - 1), LIMIT)
    assert big.value.code == ErrorCode.TOO_LARGE and big.value.fatal


def test_counts_are_bounded_before_slicing() -> None:
    payload = struct.pack("<I", MAX_KEYS + 1)  # claims 16385 keys, carries none
    with pytest.raises(ProtocolError, match=f"EXISTS_PREFIX: {MAX_KEYS + 1} keys, limit is {MAX_KEYS}"):
        m.decode_request(Op.EXISTS_PREFIX, payload, BPB)
    with pytest.raises(ProtocolError, match="GET_SHM: 2 entries need 68 bytes, got 36"):
        m.decode_request(Op.GET_SHM, struct.pack("<I", 2) + b"k" * 32, BPB)
    with pytest.raises(ProtocolError, match="unknown operation 0x0063"):
        m.decode_request(0x63, b"", BPB)
    with pytest.raises(ProtocolError, match="FLUSH: expects an empty payload"):
        m.decode_request(Op.FLUSH, b"x", BPB)
    with pytest.raises(ValueError, match="is 5 bytes, expected 32"):
        m.encode_keys([b"short"])


def test_reply_codecs_round_trip() -> None:
    slots = [(1, 5), (0, None), (1, 0)]
    assert m.decode_slots(m.encode_slots(slots), Op.GET_SHM) == slots
    blocks = [b"a" * BPB, None, b"c" * BPB]
    assert m.decode_blocks(m.encode_blocks(blocks), BPB) == blocks
    assert m.decode_flags(m.encode_flags([True, False]), Op.PUT_INLINE) == [True, False]
    assert m.decode_error(m.encode_error(ErrorCode.UNAUTHORIZED, "no")) == (ErrorCode.UNAUTHORIZED, "no")


def test_hold_table_exact() -> None:
    t = HoldTable(timeout_s=10)
    a, b = b"a" * 32, b"b" * 32
    t.grant(1, "read", [a, a, b], now=0)
    t.grant(2, "write", [b], now=5)
    assert len(t) == 4 and t.owned_by(1) == 3
    assert t.take(1, "read", [a, b, b]) == [True, True, False]
    assert t.take(1, "write", [a]) == [False]
    assert t.expire(now=9.9) == []
    assert t.expire(now=10) == [Hold(1, "read", a)]
    assert t.expire(now=15) == [Hold(2, "write", b)]
    assert len(t) == 0 and t.expired_total == 2
