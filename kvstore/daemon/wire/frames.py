"""Framing of the daemon protocol: the fixed header, the operations, the errors.

Every message, in both directions, is one frame::

    0      4        6      8            12         16
    | magic | version | op  | request_id | length  | payload (length bytes) ...
    | KVSD  |  u16    | u16 |    u32     |  u32    |

little-endian. A reply carries the request's ``op`` with :data:`REPLY_BIT`
set and the same ``request_id``; an error reply has ``op`` = ``Op.ERROR``.
The header is checked (magic, version, length bound) before a single payload
byte is read, so a hostile length never causes an allocation. Errors in the
header are *fatal* (the stream cannot be trusted to stay in step, so the
connection is closed after an error reply); errors in a payload whose length
was honoured are not (the peer gets an error reply and the connection goes on).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from kvstore.errors import KVStoreError

MAGIC = b"KVSD"
PROTOCOL_VERSION = 9
"""2: challenge-response login (CHALLENGE, HELLO carries an HMAC proof, not the token); HELLO reply has max_keys.
3: RELEASE_QUIET. 4: GET_SHM_RELEASE (a get that first ends the holds of the previous one). 5: TOUCH_QUIET, and the
slot directory after the arena's slots (gets of host-resident blocks without a round trip). 6: the arena is a
sealed memfd with no name: a HELLO reply granting shared memory is followed by :data:`ARENA_BYTE` carrying its
descriptor (``SCM_RIGHTS``); the reply's shm field is the arena's label. 7: EXISTS_CHAIN (a probe that carries the
chain from position 0, so a daemon with a remote tier can place the keys in their groups). 8: HELLO carries the
client's layout (its fields as JSON), so a daemon can open tiers for a layout it has not served before; its
reply says whether the arena is sparse (then a client does not prefault it). 9: EXISTS_PREFIX and EXISTS_CHAIN answer
which of the daemon's tiers holds the blocks found (runs of host, disk or remote blocks), so a client reports a hit
by the daemon tier that served it."""

ARENA_BYTE = b"A"
"""The one byte after a HELLO reply that grants shared memory; the arena's descriptor rides on it."""
HEADER = struct.Struct("<4sHHII")
HEADER_SIZE = HEADER.size
REPLY_BIT = 0x8000
# A block key is kvstore.hashing.KEY_BYTES long; the frame bound before login is kvstore.frame_bounds's (the config
# checks it too).
MAX_KEYS = 16384
"""Most keys in one request (512 KiB of keys); larger batches are split by the client."""
MAX_NAME_BYTES = 256
OBSERVER_FINGERPRINT = bytes(16)
"""HELLO fingerprint of a client that only reads STATS (``kvstore stats``) and so needs no layout."""
MAX_REPLY_BYTES = 1 << 31
"""Bound a client puts on reply lengths (replies are sized by the client's own requests)."""


class Op(IntEnum):
    """Operations. Values are part of the wire format: never renumber."""

    HELLO = 1
    EXISTS_PREFIX = 2
    GET_SHM = 3
    GET_INLINE = 4
    PUT_SHM_RESERVE = 5
    PUT_SHM_COMMIT = 6
    PUT_INLINE = 7
    RELEASE = 8
    DELETE = 9
    FLUSH = 10
    STATS = 11
    CHALLENGE = 12
    """Before HELLO: ask for the connection's login nonce (see :mod:`kvstore.daemon.wire.auth`)."""
    RELEASE_QUIET = 13
    """RELEASE with no reply (protocol 3): the client never waits for or reads one, which saves the daemon a
    send and the client a read per get. A non-fatal error is counted and logged by the daemon, not answered."""
    GET_SHM_RELEASE = 14
    """GET_SHM that first releases keys like RELEASE_QUIET (protocol 4): a get's RELEASE rides in the next get's
    frame, so a get costs the daemon one frame, not two. The reply is GET_SHM's."""
    TOUCH_QUIET = 15
    """Keys a client read through the slot directory (protocol 5; :mod:`kvstore.tiers.host.slot_directory`): the daemon
    counts the hits and marks the blocks used, as a GET_SHM would have. No reply, like RELEASE_QUIET."""
    EXISTS_CHAIN = 16
    """EXISTS_PREFIX of a chain sent from position 0 with the position ``start`` to count from (protocol 7): the
    daemon answers how many blocks from position 0 it can serve, its remote tier's groups included (their loads
    into its host tier start at once; a GET of them waits for them). See :mod:`kvstore.daemon.server.remote_link`."""
    ERROR = 0x7FFF
    """Reply-only: the request failed; payload is an :class:`ErrorCode` and a message."""


class ErrorCode(IntEnum):
    """Why a request failed (sent in error replies)."""

    BAD_FRAME = 1
    BAD_VERSION = 2
    UNAUTHORIZED = 3
    BAD_LAYOUT = 4
    TOO_LARGE = 5
    UNKNOWN_OP = 6
    NOT_ALLOWED = 7
    UNAVAILABLE = 8
    INTERNAL = 9
    NOT_DURABLE = 10
    """FLUSH: blocks acknowledged earlier did not reach the disk; the message says how many."""


class ProtocolError(KVStoreError):
    """A frame or message broke the protocol. ``fatal`` means the connection must be closed."""

    def __init__(self, code: ErrorCode, message: str, *, fatal: bool = False) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.fatal = fatal


class DaemonError(KVStoreError):
    """The daemon answered a request with an error reply (``code`` says why)."""

    def __init__(self, code: int, message: str) -> None:
        name = ErrorCode(code).name if code in ErrorCode._value2member_map_ else f"code {code}"
        super().__init__(f"daemon refused the request: {name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class FrameHeader:
    """A decoded, validated header. ``op`` is the raw number (an unknown op is a payload-level error)."""

    version: int
    op: int
    request_id: int
    length: int

    @property
    def is_reply(self) -> bool:
        """Whether the frame is a reply (REPLY_BIT set, or an error)."""
        return bool(self.op & REPLY_BIT) or self.op == Op.ERROR

    def op_name(self) -> str:
        """The operation's name for messages (``op 0x1234`` when unknown)."""
        base = self.op & ~REPLY_BIT
        return Op(base).name if base in Op._value2member_map_ else f"op 0x{self.op:04x}"


def encode_frame(op: int, request_id: int, payload: bytes | bytearray | memoryview = b"") -> bytes:
    """Header plus payload as one ``bytes`` (one ``sendall``)."""
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, op, request_id & 0xFFFFFFFF, len(payload)) + bytes(payload)


def decode_header(raw: bytes, max_frame_bytes: int) -> FrameHeader:
    """Validate the 16 header bytes; raise a fatal :class:`ProtocolError` naming what is wrong.

    Checks, in order: size, magic, version, and ``length <= max_frame_bytes``
    (before the payload is read, so nothing is allocated for an oversized frame).
    """
    if len(raw) != HEADER_SIZE:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header is {len(raw)} bytes, expected {HEADER_SIZE}", fatal=True)
    magic, version, op, request_id, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"bad magic {magic!r}, expected {MAGIC!r}", fatal=True)
    header = FrameHeader(version, op, request_id, length)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"{header.op_name()} uses protocol version {version}; this side speaks {PROTOCOL_VERSION}",
            fatal=True,
        )
    if length > max_frame_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"{header.op_name()} frame announces {length} payload bytes, limit is {max_frame_bytes}",
            fatal=True,
        )
    return header
