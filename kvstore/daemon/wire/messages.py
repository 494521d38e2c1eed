"""Typed messages of the daemon protocol and their payload encodings.

Payloads (little-endian; ``keys`` = ``u32 count`` then ``count`` 32-byte keys)::

    CHALLENGE        (empty)                    reply  nonce[32]
    HELLO            fingerprint[16] want_shm:u8 proof_len:u16 proof name_len:u16 name layout_len:u16 layout
                     (proof: 0 bytes, or 32 = HMAC-SHA256 of the CHALLENGE nonce, see ``auth``;
                     layout: 0 bytes (an observer), or the layout's fields as a UTF-8 JSON object)
      reply          has_salt:u8 salt_len:u16 salt shm_len:u16 shm_name bytes_per_block:u32
                     num_slots:u32 hold_timeout_ms:u32 max_frame_bytes:u32 max_keys:u32 sparse:u8
    EXISTS_PREFIX    keys                       reply  found (below)
    EXISTS_CHAIN     start:u32 keys             reply  found, of the keys from ``start``
    GET_SHM          keys                       reply  count:u32 (found:u8 slot:u32)*count
    GET_INLINE       keys                       reply  count:u32 found:u8*count block*found
    PUT_SHM_RESERVE  keys                       reply  count:u32 (state:u8 slot:u32)*count
    PUT_SHM_COMMIT   keys                       reply  count:u32 ok:u8*count
    PUT_INLINE       keys block*count           reply  count:u32 ok:u8*count
    RELEASE, DELETE  keys                       reply  count:u32
    RELEASE_QUIET    keys                       (no reply, not even an error unless the connection closes)
    TOUCH_QUIET      keys                       (no reply, like RELEASE_QUIET: blocks read through the slot directory)
    GET_SHM_RELEASE  keys(release) keys(get)    reply  as GET_SHM (the release runs first; a frame
                     refused as malformed or too large changes nothing)
    FLUSH, STATS     (empty)                    reply  (empty) / UTF-8 JSON
    ERROR            (reply only)               code:u16 message (UTF-8)

``found`` (protocol 9) is the blocks found from the first key asked for, in runs by the daemon tier that holds
them: ``u32 runs`` then ``(tier:u8 blocks:u32)*runs``, tier an index into :data:`FOUND_TIERS`; the count found is
the runs' sum. One round trip still answers both how much and where.

A FLUSH that could not make every acknowledged block durable is answered with
ERROR ``NOT_DURABLE`` and the message of :func:`encode_not_durable`.

Every count is checked against :data:`MAX_KEYS` and against the payload
length before anything is sliced, and every length must match exactly.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from enum import IntEnum
from collections.abc import Sequence
from typing import Any, Union

from kvstore.daemon.wire.auth import NONCE_BYTES, PROOF_BYTES
from kvstore.daemon.wire.frames import MAX_KEYS, MAX_NAME_BYTES, ErrorCode, Op, ProtocolError
from kvstore.daemon.wire.layout_check import layout_fields, layout_from_fields
from kvstore.errors import NotDurable
from kvstore.hashing import KEY_BYTES
from kvstore.layout import KVLayout

_U32 = struct.Struct("<I")
_RUN = struct.Struct("<BI")
FOUND_TIERS = ("host", "disk", "remote")
"""The daemon's tiers a found block can be in, by their code in a ``found`` reply. Values are part of the wire
format: never reorder."""
Runs = tuple[tuple[str, int], ...]
"""Found blocks in key order as ``(tier, blocks)`` runs, tier one of :data:`FOUND_TIERS`, every run non-empty."""
_SLOT = struct.Struct("<BI")
_HELLO = struct.Struct("<16sBH")
_HELLO_TAIL = struct.Struct("<IIIIIB")
MAX_LAYOUT_BYTES = 1024
"""A HELLO's layout JSON: six short fields (a model id of a few hundred characters at most)."""
KEY_OPS = frozenset(
    {Op.EXISTS_PREFIX, Op.GET_SHM, Op.GET_INLINE, Op.PUT_SHM_RESERVE, Op.PUT_SHM_COMMIT, Op.RELEASE, Op.RELEASE_QUIET,
     Op.TOUCH_QUIET, Op.DELETE}
)
EMPTY_OPS = frozenset({Op.FLUSH, Op.STATS, Op.CHALLENGE})


class PutState(IntEnum):
    """Outcome of reserving a slot for one key (PUT_SHM_RESERVE)."""

    NO_ROOM = 0
    """Every slot is locked or reserved; the block was not stored."""
    RESERVED = 1
    """A slot is reserved: write the block into it, then PUT_SHM_COMMIT."""
    PRESENT = 2
    """The block is already stored (host or disk); nothing to write."""
    BUSY = 3
    """Not reserved now: another client is writing the same block, or this connection holds its share of the
    host slots already (``RESERVE_SHARE`` in :mod:`kvstore.daemon.server.share`) or has quarantined slots. A miss
    for that key; a later reserve may succeed."""


@dataclass(frozen=True)
class Hello:
    """The login request (after CHALLENGE when it carries a proof)."""

    fingerprint: bytes
    proof: bytes | None
    """HMAC of the connection's nonce with the client's token (:func:`kvstore.daemon.wire.auth.login_proof`);
    ``None``: no token (allowed only for local clients, which get the untenanted namespace)."""
    client_name: str
    want_shm: bool
    layout: KVLayout | None = None
    """The client's KV layout, whose :attr:`~KVLayout.fingerprint` must be ``fingerprint``: a daemon serving
    several layouts opens this one's tiers on first use. ``None``: an observer (stats only)."""


@dataclass(frozen=True)
class KeysRequest:
    """A request whose payload is a list of block keys."""

    op: Op
    keys: tuple[bytes, ...]
    start: int = 0
    """EXISTS_CHAIN only: the chain position the client's own copies reach (``keys`` start at position 0)."""


@dataclass(frozen=True)
class GetRelease:
    """GET_SHM_RELEASE: end the holds on ``release`` (as RELEASE_QUIET), then GET_SHM ``keys``."""

    release: tuple[bytes, ...]
    keys: tuple[bytes, ...]
    op = Op.GET_SHM_RELEASE

    @property
    def get(self) -> KeysRequest:
        """The GET_SHM part."""
        return KeysRequest(Op.GET_SHM, self.keys)


@dataclass(frozen=True)
class PutInline:
    """Blocks sent as bytes (remote clients)."""

    keys: tuple[bytes, ...]
    blocks: tuple[memoryview, ...]


@dataclass(frozen=True)
class EmptyRequest:
    """FLUSH, STATS or CHALLENGE."""

    op: Op


Request = Union[Hello, KeysRequest, GetRelease, PutInline, EmptyRequest]


@dataclass(frozen=True)
class HelloReply:
    """What the daemon tells a client at handshake."""

    salt: bytes | None
    shm_name: str | None
    bytes_per_block: int
    num_slots: int
    hold_timeout_s: float
    max_frame_bytes: int
    max_keys: int
    """Most keys the daemon accepts in one request (``daemon.max_keys_per_request``)."""
    sparse: bool = False
    """The arena's pages exist only where slots are in use (a daemon serving any layout, whose arenas share one
    budget): a client must not prefault its mapping, which would allocate all of them."""


# ------------------------------------------------------------------ helpers
def _need(cond: bool, op: Op | str, what: str) -> None:
    if not cond:
        name = op.name if isinstance(op, Op) else op
        raise ProtocolError(ErrorCode.BAD_FRAME, f"{name}: {what}")


def _count(payload: memoryview, op: Op, per_item: int, extra: int = 0) -> int:
    """Read the leading u32 count and check the payload holds exactly ``count * per_item + extra`` more bytes."""
    _need(len(payload) >= 4, op, f"payload of {len(payload)} bytes has no count")
    (n,) = _U32.unpack_from(payload)
    if n > MAX_KEYS:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{op.name}: {n} keys, limit is {MAX_KEYS}")
    _need(len(payload) == 4 + n * per_item + extra, op, f"{n} entries need {4 + n * per_item + extra} bytes, got {len(payload)}")
    return n


def encode_keys(keys: Sequence[bytes]) -> bytes:
    """``u32 count`` + the keys; raises ``ValueError`` naming a key that is not 32 bytes."""
    for k in keys:
        if len(k) != KEY_BYTES:
            raise ValueError(f"block key {bytes(k[:8]).hex()}… is {len(k)} bytes, expected {KEY_BYTES}")
    return _U32.pack(len(keys)) + b"".join(keys)


def _keys(payload: memoryview, op: Op, n: int) -> tuple[bytes, ...]:
    raw = bytes(payload[4 : 4 + n * KEY_BYTES])  # one copy, then slices of bytes (cheaper than n memoryview copies)
    return tuple([raw[i : i + KEY_BYTES] for i in range(0, n * KEY_BYTES, KEY_BYTES)])


def _text(raw: memoryview, op: Op, field: str, limit: int) -> str:
    _need(len(raw) <= limit, op, f"{field} is {len(raw)} bytes, limit {limit}")
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"{op.name}: {field} is not UTF-8") from None


# ----------------------------------------------------------------- requests
def encode_hello(msg: Hello) -> bytes:
    """Payload of a HELLO request."""
    proof = msg.proof or b""
    name = msg.client_name.encode()[:MAX_NAME_BYTES]
    layout = json.dumps(layout_fields(msg.layout), sort_keys=True).encode() if msg.layout is not None else b""
    return (_HELLO.pack(msg.fingerprint, int(msg.want_shm), len(proof)) + proof + struct.pack("<H", len(name)) + name
            + struct.pack("<H", len(layout)) + layout)


def encode_chain(keys: Sequence[bytes], start: int) -> bytes:
    """Payload of an EXISTS_CHAIN request: ``u32 start``, then the chain's keys from position 0."""
    return _U32.pack(start) + encode_keys(keys)


def encode_get_release(release: Sequence[bytes], keys: Sequence[bytes]) -> bytes:
    """Payload of a GET_SHM_RELEASE request: the keys to release, then the keys to get."""
    return encode_keys(list(release)) + encode_keys(list(keys))


def encode_put_inline(keys: list[bytes], blocks: list[bytes | memoryview]) -> bytes:
    """Payload of a PUT_INLINE request (keys, then the blocks in the same order)."""
    return encode_keys(keys) + b"".join(bytes(b) for b in blocks)


def decode_request(op_num: int, payload: bytes | memoryview, block_bytes: int) -> Request:
    """Parse a request payload for ``op_num``; raise :class:`ProtocolError` naming the op and the field."""
    view = memoryview(payload)
    if op_num not in Op._value2member_map_ or op_num == Op.ERROR:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown operation 0x{op_num:04x}")
    op = Op(op_num)
    if op == Op.HELLO:
        _need(len(view) >= _HELLO.size + 2, op, f"payload of {len(view)} bytes is shorter than {_HELLO.size + 2}")
        fp, want_shm, plen = _HELLO.unpack_from(view)
        _need(plen in (0, PROOF_BYTES), op, f"proof is {plen} bytes, expected 0 or {PROOF_BYTES}")
        _need(len(view) >= _HELLO.size + plen + 2, op, f"proof length {plen} overruns the payload")
        proof = bytes(view[_HELLO.size : _HELLO.size + plen])
        at = _HELLO.size + plen
        (nlen,) = struct.unpack_from("<H", view, at)
        _need(len(view) >= at + 4 + nlen, op, f"client name length {nlen} overruns the payload")
        name = _text(view[at + 2 : at + 2 + nlen], op, "client name", MAX_NAME_BYTES)
        at += 2 + nlen
        (llen,) = struct.unpack_from("<H", view, at)
        _need(len(view) == at + 2 + llen, op, f"layout length {llen} does not match the payload")
        _need(want_shm in (0, 1), op, f"want_shm flag is {want_shm}, expected 0 or 1")
        layout = None
        if llen:
            text = _text(view[at + 2 :], op, "layout", MAX_LAYOUT_BYTES)
            try:
                layout = layout_from_fields(json.loads(text))
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                raise ProtocolError(ErrorCode.BAD_FRAME, f"HELLO: layout: {exc}") from None
            _need(layout.fingerprint == bytes(fp), op, "the fingerprint is not its layout's (the two sides hash "
                  "layouts differently: another kvstore version?)")
        return Hello(bytes(fp), proof or None, name, bool(want_shm), layout)
    if op in KEY_OPS:
        n = _count(view, op, KEY_BYTES)
        return KeysRequest(op, _keys(view, op, n))
    if op == Op.EXISTS_CHAIN:
        _need(len(view) >= 4, op, f"payload of {len(view)} bytes has no start position")
        (start,) = _U32.unpack_from(view)
        n = _count(view[4:], op, KEY_BYTES)
        _need(start <= n, op, f"start position {start} is past the chain's {n} keys")
        return KeysRequest(op, _keys(view[4:], op, n), start)
    if op == Op.GET_SHM_RELEASE:
        _need(len(view) >= 4, op, f"payload of {len(view)} bytes has no count of keys to release")
        (nr,) = _U32.unpack_from(view)
        if nr > MAX_KEYS:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{op.name}: {nr} keys to release, limit is {MAX_KEYS}")
        at = 4 + nr * KEY_BYTES
        _need(len(view) >= at + 4, op, f"{nr} keys to release need {at} bytes and a count of keys to get, got {len(view)}")
        n = _count(view[at:], op, KEY_BYTES)
        return GetRelease(_keys(view, op, nr), _keys(view[at:], op, n))
    if op == Op.PUT_INLINE:
        n = _count(view, op, KEY_BYTES + block_bytes)
        base = 4 + n * KEY_BYTES
        blocks = tuple(view[base + i * block_bytes : base + (i + 1) * block_bytes] for i in range(n))
        return PutInline(_keys(view, op, n), blocks)
    _need(len(view) == 0, op, f"expects an empty payload, got {len(view)} bytes")
    return EmptyRequest(op)


# ------------------------------------------------------------------ replies
def encode_hello_reply(r: HelloReply) -> bytes:
    """Payload of the HELLO reply."""
    salt = r.salt or b""
    shm = (r.shm_name or "").encode()
    head = struct.pack("<BH", int(r.salt is not None), len(salt)) + salt + struct.pack("<H", len(shm)) + shm
    return head + _HELLO_TAIL.pack(r.bytes_per_block, r.num_slots, int(r.hold_timeout_s * 1000),
                                   min(r.max_frame_bytes, 2**32 - 1), r.max_keys, int(r.sparse))


def decode_hello_reply(payload: bytes) -> HelloReply:
    """Parse the HELLO reply (raises :class:`ProtocolError` on a malformed one)."""
    v = memoryview(payload)
    try:
        has_salt, slen = struct.unpack_from("<BH", v)
        salt = bytes(v[3 : 3 + slen])
        (mlen,) = struct.unpack_from("<H", v, 3 + slen)
        shm = bytes(v[5 + slen : 5 + slen + mlen]).decode()
        bpb, slots, hold_ms, max_frame, max_keys, sparse = _HELLO_TAIL.unpack_from(v, 5 + slen + mlen)
    except (struct.error, UnicodeDecodeError) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"HELLO reply is malformed: {exc}") from None
    return HelloReply(salt if has_salt else None, shm or None, bpb, slots, hold_ms / 1000, max_frame, max_keys,
                      bool(sparse))


def decode_challenge(payload: bytes) -> bytes:
    """The nonce of a CHALLENGE reply (raises :class:`ProtocolError` unless it is exactly 32 bytes)."""
    _need(len(payload) == NONCE_BYTES, Op.CHALLENGE, f"reply is {len(payload)} bytes, expected {NONCE_BYTES}")
    return bytes(payload)


def _slots_struct(n: int) -> struct.Struct:
    """``n`` (state, slot) pairs packed back to back (one ``pack`` / ``unpack`` per reply, not one per entry)."""
    st = _SLOTS.get(n)
    if st is None:
        st = struct.Struct("<" + "BI" * n)
        if len(_SLOTS) < 64:  # the sizes a client uses (its batch, the tail of a call): a few
            _SLOTS[n] = st
    return st


_SLOTS: dict[int, struct.Struct] = {}


def encode_slots(entries: list[tuple[int, int | None]]) -> bytes:
    """``(state, slot)`` pairs (GET_SHM: state 1 = found; PUT_SHM_RESERVE: a :class:`PutState`)."""
    flat: list[int] = []
    for state, slot in entries:
        flat += (state, 0 if slot is None else slot)
    return _U32.pack(len(entries)) + _slots_struct(len(entries)).pack(*flat)


def decode_slots(payload: bytes, op: Op) -> list[tuple[int, int | None]]:
    """Inverse of :func:`encode_slots`; the slot is ``None`` unless the state is 1 (found / reserved)."""
    v = memoryview(payload)
    n = _count(v, op, _SLOT.size)
    flat = _slots_struct(n).unpack_from(v, 4)
    # GET_SHM found and PutState.RESERVED are both 1
    return [(state, slot if state == 1 else None) for state, slot in zip(flat[0::2], flat[1::2])]


def encode_flags(flags: list[bool]) -> bytes:
    """``u32 count`` + one byte per flag."""
    return _U32.pack(len(flags)) + bytes(int(f) for f in flags)


def decode_flags(payload: bytes, op: Op) -> list[bool]:
    """Inverse of :func:`encode_flags`."""
    v = memoryview(payload)
    n = _count(v, op, 1)
    return [b == 1 for b in v[4 : 4 + n]]


def encode_blocks(blocks: Sequence[bytes | memoryview | None]) -> bytes:
    """GET_INLINE reply: found flags, then the found blocks in order."""
    return encode_flags([b is not None for b in blocks]) + b"".join(bytes(b) for b in blocks if b is not None)


@dataclass(frozen=True)
class PackedBlocks:
    """A GET_INLINE reply not yet joined: the found flags and the found blocks back to back in ``data``
    (:meth:`parts` are what :func:`encode_blocks` would return, in two pieces, so the daemon sends the
    blocks from the one buffer they were read into)."""

    found: list[bool]
    data: bytearray

    def parts(self) -> tuple[bytes, memoryview]:
        """The reply payload as (flags, blocks)."""
        return encode_flags(self.found), memoryview(self.data)


def decode_blocks(payload: bytes, block_bytes: int) -> list[bytes | None]:
    """Inverse of :func:`encode_blocks`."""
    v = memoryview(payload)
    _need(len(v) >= 4, Op.GET_INLINE, "reply has no count")
    (n,) = _U32.unpack_from(v)
    _need(n <= MAX_KEYS and len(v) >= 4 + n, Op.GET_INLINE, f"reply count {n} is out of bounds")
    flags = [b == 1 for b in v[4 : 4 + n]]
    _need(len(v) == 4 + n + sum(flags) * block_bytes, Op.GET_INLINE, "reply length does not match its found blocks")
    out: list[bytes | None] = []
    at = 4 + n
    for f in flags:
        out.append(bytes(v[at : at + block_bytes]) if f else None)
        at += block_bytes if f else 0
    return out


def encode_count(n: int) -> bytes:
    """``u32``."""
    return _U32.pack(n)


def decode_count(payload: bytes, op: Op) -> int:
    """Inverse of :func:`encode_count`."""
    _need(len(payload) == 4, op, f"count reply is {len(payload)} bytes, expected 4")
    return int(_U32.unpack(payload)[0])


def encode_found(runs: Runs) -> bytes:
    """The ``found`` reply of EXISTS_PREFIX and EXISTS_CHAIN (see the module docstring)."""
    return _U32.pack(len(runs)) + b"".join(_RUN.pack(FOUND_TIERS.index(t), n) for t, n in runs)


def decode_found(payload: bytes, op: Op, asked: int) -> Runs:
    """Inverse of :func:`encode_found`, checking that the runs name known tiers, are non-empty, and add up to at
    most the ``asked`` keys."""
    view = memoryview(payload)
    n = _count(view, op, _RUN.size)
    runs = tuple(_RUN.unpack_from(view, 4 + i * _RUN.size) for i in range(n))
    _need(all(code < len(FOUND_TIERS) and blocks > 0 for code, blocks in runs), op,
          f"found runs {runs} name an unknown tier or an empty run")
    total = sum(blocks for _, blocks in runs)
    _need(total <= asked, op, f"{total} blocks found of {asked} asked for")
    return tuple((FOUND_TIERS[code], blocks) for code, blocks in runs)


def encode_error(code: ErrorCode, message: str) -> bytes:
    """ERROR payload: ``u16 code`` + UTF-8 message (truncated to 1 KiB)."""
    return struct.pack("<H", int(code)) + message.encode("utf-8", "replace")[:1024]


def decode_error(payload: bytes) -> tuple[int, str]:
    """Inverse of :func:`encode_error`."""
    if len(payload) < 2:
        return int(ErrorCode.BAD_FRAME), "error reply without a code"
    return struct.unpack_from("<H", payload)[0], payload[2:].decode("utf-8", "replace")


_NOT_DURABLE = re.compile(r"^FLUSH: (\d+) acknowledged blocks are not durable \((\d+) since the daemon started\): (.*)$", re.S)


def encode_not_durable(exc: NotDurable) -> str:
    """The ERROR message of a ``NOT_DURABLE`` FLUSH reply (counts first, so a client can read them back)."""
    return f"FLUSH: {exc.blocks} acknowledged blocks are not durable ({exc.total} since the daemon started): {exc.detail}"


def decode_not_durable(message: str) -> NotDurable:
    """Inverse of :func:`encode_not_durable`; raises :class:`ProtocolError` for any other message."""
    match = _NOT_DURABLE.match(message)
    if match is None:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"FLUSH: malformed NOT_DURABLE message {message[:80]!r}")
    return NotDurable(int(match.group(1)), int(match.group(2)), match.group(3))


def encode_json(data: dict[str, Any]) -> bytes:
    """STATS reply."""
    return json.dumps(data, sort_keys=True).encode()


def decode_json(payload: bytes) -> dict[str, Any]:
    """Inverse of :func:`encode_json`."""
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"STATS reply is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "STATS reply is not a JSON object")
    return data
