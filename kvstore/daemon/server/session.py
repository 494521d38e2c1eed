"""One client connection of the daemon: login, then request by request until it closes.

One file past 500 lines, on purpose: a session is one connection's state (login, the frame being read
under its deadline and the in-flight budget, the bounds of each request, dispatch to the backend); the
bounds read that state (logged in or not, the holds it has, the budget it took), so they stay with it.

::

    read 16-byte header ─► decode_header (magic, version, length bound; fatal)
                           bound: 4 KiB before login, daemon.max_frame_bytes after
    read payload       ─► decode_request (op, counts, lengths; error reply, go on)
    login              ─► CHALLENGE (nonce) then HELLO (HMAC proof of a token, layout fingerprint);
                           the token decides the tenant; reply with salt + shm, then (shm
                           granted) one byte carrying the arena's descriptor (SCM_RIGHTS)
    dispatch           ─► keys mapped into the tenant's namespace ─► backend call ─► reply
                           (on the executor when it may wait for disk I/O, else on the event loop)

Time limits: the login must finish within ``login_timeout_s`` of connecting;
after it, a connection may be silent ``idle_timeout_s`` between requests and a
frame that has begun must arrive within ``read_timeout_s``. A fatal error (bad
header, failed login, a timeout) gets one error reply (timeouts: none), then
the connection is closed. A client vanishing (EOF mid-header or mid-payload, a
reset) just ends the session; its holds end at their deadlines.
"""

from __future__ import annotations

import array
import asyncio
import logging
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvstore.config.schema import DaemonConfig
from kvstore.daemon.wire import messages as m
from kvstore.daemon.server.admission import LoginThrottle, Peer
from kvstore.daemon.wire.auth import new_nonce, token_for_proof
from kvstore.daemon.server.holds import HOLDS_PER_SLOT
from kvstore.daemon.server.inflight import InflightBudget
from kvstore.daemon.wire.frames import (
    ARENA_BYTE, HEADER, HEADER_SIZE, MAGIC, OBSERVER_FINGERPRINT, PROTOCOL_VERSION, REPLY_BIT, ErrorCode,
    FrameHeader, Op, ProtocolError, decode_header, encode_frame,
)
from kvstore.daemon.server.metrics import DaemonMetrics
from kvstore.daemon.server.shelves import Shelf, Shelves
from kvstore.daemon.server.tenancy import Tenant, TenantCounters
from kvstore.errors import KVStoreError, NotDurable
from kvstore.frame_bounds import PRELOGIN_FRAME_BYTES
from kvstore.util.ratelog import RateLimitedLog

if TYPE_CHECKING:  # the storage brings torch: imported when the first layout opens (kvstore.tiers)
    from kvstore.daemon.server.backend import DaemonBackend

log = logging.getLogger(__name__)
T = TypeVar("T")

SHM_OPS = frozenset({Op.GET_SHM, Op.GET_SHM_RELEASE, Op.PUT_SHM_RESERVE, Op.PUT_SHM_COMMIT, Op.TOUCH_QUIET})
DISTINCT_OPS = frozenset({Op.GET_INLINE, Op.GET_SHM, Op.GET_SHM_RELEASE, Op.PUT_SHM_RESERVE, Op.PUT_SHM_COMMIT,
                          Op.PUT_INLINE})
"""Requests that may not name a key twice (:meth:`Session._check_distinct`)."""
SEND_PIECE = 1 << 20
"""Bytes of a reply handed to the transport at a time (:meth:`Session._send`)."""
HOLDING_OPS = frozenset({Op.GET_SHM, Op.PUT_SHM_RESERVE})
"""Requests that grant holds (GET_SHM_RELEASE arrives here as its GET_SHM): bounded per connection."""
QUIET_OPS = frozenset({Op.RELEASE_QUIET, Op.TOUCH_QUIET})
"""Requests never answered, not even with an error: their client reads no reply."""


class SessionTimeout(Exception):
    """The peer was too slow (login, a frame, or idle); the message says which limit."""


@dataclass
class SessionContext:
    """What every session shares: config, storage, metrics, the executor, the stats callback, and the
    login and tenant ledgers (owned by the server, touched only on the event loop)."""

    daemon: DaemonConfig
    shelves: Shelves
    """The layouts served, each with its storage; a client's HELLO picks (or opens) its own."""
    metrics: DaemonMetrics
    executor: Executor
    stats: Callable[[], Awaitable[dict[str, Any]]]
    throttle: LoginThrottle
    events: RateLimitedLog
    """Logs what a hostile peer can repeat at will (refusals, errors, timeouts) once per interval."""
    tenants: dict[str, Tenant]
    """Token -> tenant, from ``daemon.tenant_salts``."""
    tenant_counters: dict[str, TenantCounters]
    """Tenant label -> its counters."""
    inflight: InflightBudget
    """The bytes of payloads and inline replies in flight, across connections (:mod:`kvstore.daemon.server.inflight`)."""


class Session:
    """Serves one connection; :attr:`busy` is true while a request is being executed."""

    def __init__(self, conn_id: int, peer: Peer, ctx: SessionContext) -> None:
        self.conn_id, self.peer, self.ctx = conn_id, peer, ctx
        self.transport = peer.transport
        self.hello: m.Hello | None = None
        self.nonce: bytes | None = None
        self.tenant: Tenant | None = None
        self.shelf: Shelf | None = None
        """The storage of the client's layout, from its HELLO (``None`` before, and for an observer)."""
        self.shm = False
        self.observer = False
        self.busy = False
        self.writer: asyncio.StreamWriter | None = None
        self.flush_mark = 0  # FLUSH reports write failures after this mark: since start, then since the last FLUSH
        self._taken = 0  # bytes of the in-flight budget this connection holds now (its request and its reply)
        self._login_deadline = 0.0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Run the request loop until the peer closes, breaks the protocol fatally, times out, or the daemon stops."""
        self.writer = writer
        met = self.ctx.metrics
        met.clients += 1
        met.connections += 1
        self._login_deadline = asyncio.get_running_loop().time() + self.ctx.daemon.login_timeout_s
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            log.debug("client %d (%s) vanished mid-request", self.conn_id, self.transport)
        except SessionTimeout as exc:
            self.ctx.events.warning("timeout", "client %d (%s): %s; closing", self.conn_id, self.peer.ident, exc)
        finally:
            met.clients -= 1
            writer.close()
            if self.hello is not None:
                log.info("client %d (%s, %s) disconnected", self.conn_id, self.transport, self._name())

    def _limit(self, between_requests: bool) -> tuple[float, str]:
        """The loop-clock deadline that applies now, and the limit's description for :class:`SessionTimeout`."""
        cfg, now = self.ctx.daemon, asyncio.get_running_loop().time()
        if self.hello is None:
            return self._login_deadline, f"no login within daemon.login_timeout_s = {cfg.login_timeout_s:g} s"
        if between_requests:
            return now + cfg.idle_timeout_s, f"idle for daemon.idle_timeout_s = {cfg.idle_timeout_s:g} s"
        return now + cfg.read_timeout_s, f"a frame took longer than daemon.read_timeout_s = {cfg.read_timeout_s:g} s"

    async def _read_frame(self, reader: asyncio.StreamReader) -> tuple[bytes, FrameHeader | ProtocolError, bytes] | None:
        """The next frame: raw header, the decoded header (or why it is refused: then no payload is read)
        and the payload; ``None`` when the peer closed the connection before or inside a header. Raises
        :class:`SessionTimeout`, or ``IncompleteReadError`` when the peer vanished inside a payload.

        One timer per frame, not one per read: the idle (or login) deadline covers the header, then the
        same scope moves to the frame deadline for the payload (each ``asyncio.timeout`` entry costs a
        timer handle and a cancel, about as much as reading a payload that is already buffered).
        """
        deadline, what = self._limit(between_requests=True)
        loop = asyncio.get_running_loop()
        try:
            if sys.version_info < (3, 11):  # no asyncio.timeout: wait_for per read
                raw = await self._header(asyncio.wait_for(reader.readexactly(HEADER_SIZE), max(0.0, deadline - loop.time())))
                if raw is None:
                    return None
                header = self._decode_header(raw)
                if isinstance(header, ProtocolError) or header.length == 0:
                    return raw, header, b""
                await self._take(header.length, f"a {header.op_name()} payload of {header.length} bytes")
                deadline, what = self._limit(between_requests=False)
                return raw, header, await asyncio.wait_for(reader.readexactly(header.length), max(0.0, deadline - loop.time()))
            async with asyncio.timeout_at(deadline) as scope:
                raw = await self._header(reader.readexactly(HEADER_SIZE))
                if raw is None:
                    return None
                header = self._decode_header(raw)
                if isinstance(header, ProtocolError) or header.length == 0:
                    return raw, header, b""
                scope.reschedule(None)
                await self._take(header.length, f"a {header.op_name()} payload of {header.length} bytes")
                deadline, what = self._limit(between_requests=False)
                scope.reschedule(deadline)
                return raw, header, await reader.readexactly(header.length)
        except asyncio.TimeoutError:
            raise SessionTimeout(what) from None

    async def _take(self, n: int, what: str) -> None:
        """Take ``n`` bytes of the daemon's in-flight budget for this request (given back by :meth:`_one`
        once it is answered); :class:`SessionTimeout` naming the limit when they do not come free within
        ``read_timeout_s``. Frames before login (at most 4 KiB) are not counted."""
        if self.hello is None:
            return
        cfg, budget = self.ctx.daemon, self.ctx.inflight
        if not await budget.take(n, cfg.read_timeout_s):
            raise SessionTimeout(f"{what} found no room within daemon.read_timeout_s = {cfg.read_timeout_s:g} s: "
                                 f"{budget.used} of daemon.max_inflight_bytes = {budget.limit} bytes are in flight")
        self._taken += n

    async def _header(self, read: Awaitable[bytes]) -> bytes | None:
        """The 16 header bytes, or ``None`` when the peer closed the connection before all of them came."""
        try:
            return await read
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                log.debug("client %d closed mid-header (%d bytes)", self.conn_id, len(exc.partial))
            return None

    def _decode_header(self, raw: bytes) -> FrameHeader | ProtocolError:
        limit = int(self.ctx.daemon.max_frame_bytes) if self.hello is not None else PRELOGIN_FRAME_BYTES
        try:
            return decode_header(raw, limit)
        except ProtocolError as exc:
            if self.hello is None and exc.code == ErrorCode.TOO_LARGE:
                exc = ProtocolError(exc.code, f"{exc.message} before login", fatal=True)
            return exc

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read, run and answer one request; ``False`` ends the session. Whatever in-flight budget the
        request took (its payload, its reply) is given back when it has been answered or the session ends."""
        try:
            return await self._answer(reader, writer)
        finally:
            if self._taken:
                self.ctx.inflight.give(self._taken)
                self._taken = 0

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        frame = await self._read_frame(reader)
        if frame is None:
            return False
        raw, header, payload = frame
        if isinstance(header, ProtocolError):
            request_id = int.from_bytes(raw[8:12], "little")
            await self._error(writer, request_id, header)
            return False
        self.ctx.metrics.bytes_in += HEADER_SIZE + header.length
        start = time.perf_counter()
        self.busy = True
        quiet = header.op in QUIET_OPS and self.hello is not None  # its client reads no reply
        try:
            reply = await self._handle(header.op, payload)
        except ProtocolError as exc:
            await self._error(writer, header.request_id, exc, answer=exc.fatal or not quiet)
            return not exc.fatal
        except (KVStoreError, ValueError) as exc:
            await self._error(writer, header.request_id, ProtocolError(ErrorCode.INTERNAL, f"{header.op_name()}: {exc}"),
                              answer=not quiet)
            return True
        finally:
            self.busy = False
        if quiet:
            self.ctx.metrics.observe(Op(header.op).name, time.perf_counter() - start)
            return True
        if isinstance(reply, m.PackedBlocks):
            flags, blocks = reply.parts()
            head = HEADER.pack(MAGIC, PROTOCOL_VERSION, header.op | REPLY_BIT, header.request_id, len(flags) + len(blocks))
            await self._send(writer, head + flags, blocks)
        else:
            await self._send(writer, encode_frame(header.op | REPLY_BIT, header.request_id, reply))
            if header.op == Op.HELLO and self.shm:
                await self._pass_arena(writer)
        self.ctx.metrics.observe(Op(header.op).name, time.perf_counter() - start)
        return True

    async def _handle(self, op_num: int, payload: bytes) -> bytes | m.PackedBlocks:
        msg = m.decode_request(op_num, payload, self.shelf.layout.bytes_per_block if self.shelf is not None else 0)
        is_challenge = isinstance(msg, m.EmptyRequest) and msg.op == Op.CHALLENGE
        if self.hello is None:
            if is_challenge:
                if self.nonce is not None:
                    raise ProtocolError(ErrorCode.NOT_ALLOWED, "CHALLENGE: asked twice on one connection", fatal=True)
                self.nonce = new_nonce()
                return self.nonce
            if not isinstance(msg, m.Hello):
                raise ProtocolError(ErrorCode.UNAUTHORIZED, f"{Op(op_num).name} before HELLO", fatal=True)
            return await self._handshake(msg)
        if isinstance(msg, m.Hello) or is_challenge:
            raise ProtocolError(ErrorCode.NOT_ALLOWED, f"{Op(op_num).name}: the connection is already logged in")
        op = Op.PUT_INLINE if isinstance(msg, m.PutInline) else msg.op
        if self.observer and op != Op.STATS:
            raise ProtocolError(ErrorCode.NOT_ALLOWED, f"{op.name}: an observer connection (zero fingerprint) may only ask STATS")
        if op in SHM_OPS and not self.shm:
            raise ProtocolError(ErrorCode.NOT_ALLOWED, f"{op.name}: shared memory is only for untenanted local clients that asked for it")
        if isinstance(msg, (m.KeysRequest, m.PutInline, m.GetRelease)):
            self._check_size(op, len(msg.keys))
            if op in DISTINCT_OPS:
                self._check_distinct(op, msg.keys)
        if isinstance(msg, m.GetRelease):
            self._check_size(op, len(msg.release), "keys to release")
            self.backend.release(self.conn_id, self._keys(msg.release))  # first: it frees what the get may need
            msg = msg.get
        if isinstance(msg, m.KeysRequest) and msg.op in HOLDING_OPS:
            self._check_holds(op, len(msg.keys))
        if op == Op.GET_INLINE and isinstance(msg, m.KeysRequest):
            await self._take_reply(self._inline_reply_bound(len(msg.keys)))
        return await self._run(self._dispatch, msg)

    def _check_distinct(self, op: Op, keys: Sequence[bytes]) -> None:
        """Refuse a request that names a key twice: a GET_INLINE reply repeats the block for every mention
        (a 32 KiB request naming one key 1,023 times asked for a 67 MB reply) and a GET_SHM or a reserve
        grants a hold per mention. The client library asks for each key once."""
        if len(set(keys)) == len(keys):
            return
        seen: set[bytes] = set()
        for twice in keys:
            if twice in seen:
                break
            seen.add(twice)
        raise ProtocolError(ErrorCode.NOT_ALLOWED, f"{op.name}: key {twice.hex()[:16]}… is named "
                            f"{list(keys).count(twice)} times in one request of {len(keys)} keys; name each key once")

    def _check_holds(self, op: Op, n: int) -> None:
        """Refuse a request whose holds would take this connection past the backend's limit
        (:data:`HOLDS_PER_SLOT` per host slot): a client that keeps asking without releasing (100 GET_SHMs of one key made 1.6 M holds)."""
        b = self.backend
        have, limit = b.holds.owned_by(self.conn_id), b.hold_limit()
        if have + n > limit:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{op.name}: this connection holds {have} host slot references "
                                f"and asks for up to {n} more; at most {limit} per connection ({HOLDS_PER_SLOT} per host slot): "
                                "RELEASE what it has copied")

    def _inline_reply_bound(self, n: int) -> int:
        """Most bytes a GET_INLINE reply of ``n`` keys takes (every block found)."""
        return 4 + n * (1 + self.backend.layout.bytes_per_block)

    async def _take_reply(self, n: int) -> None:
        """Take the in-flight budget for a reply of up to ``n`` bytes before it is built (given back once the
        client has taken it); an UNAVAILABLE error (the connection stays) when none comes free in time."""
        cfg, budget = self.ctx.daemon, self.ctx.inflight
        if not await budget.take(n, cfg.read_timeout_s):
            raise ProtocolError(ErrorCode.UNAVAILABLE, f"GET_INLINE: no room for a reply of up to {n} bytes within "
                                f"daemon.read_timeout_s = {cfg.read_timeout_s:g} s: {budget.used} of "
                                f"daemon.max_inflight_bytes = {budget.limit} bytes are in flight; retry")
        self._taken += n

    def _check_size(self, op: Op, n: int, what: str = "keys") -> None:
        """Refuse a request over the key limit, or a GET_INLINE whose reply could exceed the frame bound,
        before any work or allocation for it."""
        cfg = self.ctx.daemon
        if n > cfg.max_keys_per_request:
            raise ProtocolError(ErrorCode.TOO_LARGE,
                                f"{op.name}: {n} {what}, limit is {cfg.max_keys_per_request} (daemon.max_keys_per_request)")
        worst = self._inline_reply_bound(n)
        if op == Op.GET_INLINE and worst > int(cfg.max_frame_bytes):
            raise ProtocolError(ErrorCode.TOO_LARGE, f"GET_INLINE: {n} keys need a reply of up to {worst} bytes, "
                                f"limit is {int(cfg.max_frame_bytes)} (daemon.max_frame_bytes)")

    def _login_failed(self, why: str) -> ProtocolError:
        self.ctx.throttle.failed(self.peer)
        return ProtocolError(ErrorCode.UNAUTHORIZED, f"HELLO: {why}", fatal=True)

    async def _handshake(self, hello: m.Hello) -> bytes:
        cfg = self.ctx.daemon
        locked = self.ctx.throttle.locked_for(self.peer)
        if locked and (self.transport == "tcp" or hello.proof is not None):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, f"HELLO: too many failed logins from {self.peer.ident}; "
                                f"refused for another {locked:.0f} s", fatal=True)
        token = None
        if hello.proof is not None:
            nonce, self.nonce = self.nonce, None  # one login attempt per nonce
            if nonce is None:
                raise self._login_failed("a token proof needs a CHALLENGE first")
            known = [t for t in [cfg.token, *cfg.tenant_salts] if t]
            token = token_for_proof(hello.proof, known, nonce, self.transport, hello.fingerprint, hello.want_shm,
                                    hello.client_name)
            if token is None:
                raise self._login_failed("wrong token (the proof matches no token this daemon knows)")
        elif self.transport == "tcp":
            raise self._login_failed("TCP clients must log in with a token (CHALLENGE, then a proof)")
        self.observer = hello.fingerprint == OBSERVER_FINGERPRINT
        tenant = self.ctx.tenants.get(token) if token else None
        self.shelf = await self.ctx.shelves.for_client(hello.fingerprint, hello.layout,
                                                       tenant.label if tenant is not None else None)
        self.hello = hello
        self.tenant = tenant
        # A tenant never maps the shared arena: it holds every namespace's blocks.
        shelf = self.shelf
        self.shm = (hello.want_shm and self.transport == "unix" and shelf is not None and self.tenant is None
                    and shelf.shm_name is not None)
        salt = cfg.tenant_salts.get(token) if token else None
        log.info("client %d (%s, %s) connected, layout %s, shm=%s, tenant %s", self.conn_id, self.peer.ident,
                 self._name(), shelf.label if shelf is not None else "none (observer)", self.shm,
                 self.tenant.label if self.tenant else "none")
        return m.encode_hello_reply(m.HelloReply(
            salt.encode() if salt else None, shelf.shm_name if self.shm and shelf is not None else None,
            shelf.layout.bytes_per_block if shelf is not None else 0,
            shelf.backend.host.num_slots if shelf is not None else 0, cfg.hold_timeout_s, int(cfg.max_frame_bytes),
            cfg.max_keys_per_request, shelf is not None and shelf.backend.host.capacity is not None,
        ))

    async def _run(self, fn: Callable[[m.Request], bytes | m.PackedBlocks], msg: m.Request) -> bytes | m.PackedBlocks:
        if isinstance(msg, m.EmptyRequest) and msg.op == Op.STATS:
            if self.tenant is not None:  # a tenant sees its own counters, nothing of anyone else
                return m.encode_json({
                    "tenant": {"label": self.tenant.label, **self._counters().as_dict()},
                    "daemon": self._layout_facts(),
                })
            return m.encode_json(await self.ctx.stats())
        if isinstance(msg, m.KeysRequest) and self._on_loop(msg):
            return fn(msg)
        if isinstance(msg, m.KeysRequest) and msg.op == Op.GET_SHM:
            slots = self.backend.hold_in_host(self.conn_id, self._keys(msg.keys))
            if slots is not None:  # all in host memory: no disk read, so no executor hop
                return m.encode_slots([(0, None) if s is None else (1, s) for s in slots])
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.ctx.executor, fn, msg)

    def _on_loop(self, msg: m.KeysRequest) -> bool:
        """Whether ``msg`` runs on the event loop: it only takes the backend's mutex for microseconds and
        never waits for disk I/O (see :class:`DaemonBackend`). A hop to the executor and back costs two
        thread wake-ups, more than such a request's work, and with several engine processes on few cores
        each wake-up can wait a scheduler slice."""
        b = self.backend
        if msg.op in (Op.RELEASE, Op.RELEASE_QUIET, Op.TOUCH_QUIET):
            return True
        if msg.op == Op.PUT_SHM_COMMIT:
            return not b.durable_puts  # durable: waits for the disk write
        return msg.op == Op.PUT_SHM_RESERVE and b.disk is None  # with a disk it looks keys up there

    def _counters(self) -> TenantCounters:
        assert self.tenant is not None
        return self.ctx.tenant_counters.setdefault(self.tenant.label, TenantCounters())

    def _keys(self, keys: Sequence[bytes]) -> Sequence[bytes]:
        """The backend's keys for what the client sent: the tenant's namespace, or as sent when untenanted."""
        return keys if self.tenant is None else self.tenant.keys(keys)

    def _dispatch(self, msg: m.Request) -> bytes | m.PackedBlocks:
        """Run one request against the backend (on an executor thread); returns the reply payload."""
        b, me = self.backend, self.conn_id
        count = self._counters() if self.tenant is not None else None
        if count is not None:
            count.add(requests=1)
        if isinstance(msg, m.PutInline):
            stored = b.put_inline(self._keys(msg.keys), msg.blocks)
            if count is not None:
                count.add(blocks_stored=sum(stored))
            return m.encode_flags(stored)
        if isinstance(msg, m.EmptyRequest):
            try:
                self.flush_mark = b.flush(self.flush_mark)
            except NotDurable as exc:
                self.flush_mark = exc.total  # reported to this connection once
                raise ProtocolError(ErrorCode.NOT_DURABLE, m.encode_not_durable(exc)) from None
            return b""
        assert isinstance(msg, m.KeysRequest)
        keys, op = self._keys(msg.keys), msg.op
        if op == Op.EXISTS_CHAIN:
            runs = b.locate_chain(keys, msg.start)
            if count is not None:
                count.add(keys_probed=len(keys) - msg.start)
            return m.encode_found(runs)
        if op == Op.EXISTS_PREFIX:
            runs = b.locate_prefix(keys)
            if count is not None:
                count.add(keys_probed=len(keys))
            return m.encode_found(runs)
        if op == Op.GET_SHM:
            return m.encode_slots([(0, None) if s is None else (1, s) for s in b.hold_for_read(me, keys)])
        if op == Op.GET_INLINE:
            flags, data = b.read_packed(keys)  # distinct keys (_check_distinct): each read once
            found = sum(flags)
            if count is not None:
                count.add(blocks_found=found, blocks_missed=len(flags) - found)
            return m.PackedBlocks(flags, data)
        if op == Op.PUT_SHM_RESERVE:
            return m.encode_slots([(int(st), s) for st, s in b.reserve(me, keys)])
        if op == Op.PUT_SHM_COMMIT:
            return m.encode_flags(b.commit(me, keys))
        if op in (Op.RELEASE, Op.RELEASE_QUIET):
            return m.encode_count(b.release(me, keys))
        if op == Op.TOUCH_QUIET:
            return m.encode_count(b.touched(keys))
        if op != Op.DELETE:  # every keys op is handled above: reaching here is a bug, never a delete
            raise ProtocolError(ErrorCode.INTERNAL, f"{op.name}: no handler")
        n = b.delete(keys)
        if count is not None:
            count.add(blocks_deleted=n)
        return m.encode_count(n)

    async def _error(self, writer: asyncio.StreamWriter, request_id: int, exc: ProtocolError, answer: bool = True) -> None:
        """Count and log ``exc``; send it as an ERROR reply unless ``answer`` is false (a RELEASE_QUIET or
        TOUCH_QUIET, whose client reads no reply: an unasked reply would be taken for the next request's)."""
        self.ctx.metrics.error(exc.code.name)
        self.ctx.events.warning(f"error:{exc.code.name}", "client %d (%s): %s%s", self.conn_id, self.peer.ident, exc,
                                " (closing)" if exc.fatal else "" if answer else " (not answered: a quiet request)")
        if not answer:
            return
        try:
            await self._send(writer, encode_frame(Op.ERROR, request_id, m.encode_error(exc.code, exc.message)))
        except ConnectionError:
            pass  # the peer is gone already

    async def _send(self, writer: asyncio.StreamWriter, *parts: bytes | memoryview) -> None:
        """Write a reply (``parts`` back to back) in pieces of :data:`SEND_PIECE` bytes, each once the socket
        took most of the one before, so the transport never copies more than a piece of a large reply;
        all of it must be taken within ``read_timeout_s`` (a peer that never reads would pin it)."""
        cfg = self.ctx.daemon
        deadline = asyncio.get_running_loop().time() + cfg.read_timeout_s
        for part in parts:
            view = memoryview(part)
            for at in range(0, len(view), SEND_PIECE):
                writer.write(view[at : at + SEND_PIECE])
                self.ctx.metrics.bytes_out += min(SEND_PIECE, len(view) - at)
                if not writer.transport.get_write_buffer_size():
                    continue  # the kernel took all of it (a broken peer shows at the next read)
                try:
                    await within(writer.drain(), max(0.0, deadline - asyncio.get_running_loop().time()))
                except asyncio.TimeoutError:
                    raise SessionTimeout(f"the reply was not read within daemon.read_timeout_s = {cfg.read_timeout_s:g} s") from None

    async def _pass_arena(self, writer: asyncio.StreamWriter) -> None:
        """Send the shared arena's descriptor right after the HELLO reply that granted it: one byte carrying it
        as ``SCM_RIGHTS``. The arena has no name anywhere (:mod:`kvstore.tiers.host.arena`), so this is the only way
        in, and only for a client that logged in. The reply is sent first and in full (a few dozen bytes into
        an empty socket), so the byte cannot overtake it."""
        fd = self.backend.host.arena.fd
        assert fd is not None, "a shared host tier has a descriptor"
        if writer.transport.get_write_buffer_size():
            await within(writer.drain(), self.ctx.daemon.read_timeout_s)
        raw = writer.get_extra_info("socket").dup()  # a plain socket object on the same connection, for sendmsg
        try:
            sent = raw.sendmsg([ARENA_BYTE], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))],
                               socket.MSG_DONTWAIT)
        except OSError as exc:
            raise ConnectionError(f"cannot pass the arena's descriptor: {exc}") from None
        finally:
            raw.close()
        if sent != 1:
            raise ConnectionError("the client's socket took no byte of the arena's descriptor")

    def _layout_facts(self) -> dict[str, Any]:
        """The model id and block size a tenant's STATS shows: its own layout's, or (an observer) a pinned
        daemon's one layout; ``None`` for an observer of a daemon serving any layout."""
        layout = self.shelf.layout if self.shelf is not None else self.ctx.shelves.pinned
        return {"model_id": layout.model_id if layout else None,
                "bytes_per_block": layout.bytes_per_block if layout else None}

    @property
    def backend(self) -> DaemonBackend:
        """The storage of this client's layout (only after a HELLO that is not an observer's)."""
        assert self.shelf is not None, "no layout's storage before HELLO, nor for an observer"
        return self.shelf.backend

    def _name(self) -> str:
        return self.hello.client_name if self.hello is not None and self.hello.client_name else "unnamed"


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """``awaitable`` under a time limit (raises ``asyncio.TimeoutError``).

    ``asyncio.timeout`` where it exists (3.11+): it arms a timer on the current task, where
    ``wait_for`` before 3.12 wraps the awaitable in a new task, which costs a task and an
    extra loop iteration on every frame read and reply. Python 3.10 keeps ``wait_for``.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)
