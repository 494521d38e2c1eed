"""One client connection of the daemon: handshake, then request by request until it closes.

::

    read 16-byte header ─► decode_header (magic, version, length bound; fatal)
    read payload       ─► decode_request (op, counts, lengths; error reply, go on)
    first request must be HELLO: token, layout fingerprint; reply with salt + shm
    dispatch           ─► backend call on the executor ─► reply frame

A fatal error (bad header, failed handshake) gets one error reply, then the
connection is closed. A client vanishing (EOF mid-header or mid-payload, a
reset) just ends the session; its leases end at their deadlines.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal

from kvstore.config.schema import DaemonConfig
from kvstore.daemon import messages as m
from kvstore.daemon.backend import DaemonBackend
from kvstore.daemon.frames import HEADER_SIZE, OBSERVER_FINGERPRINT, REPLY_BIT, ErrorCode, Op, ProtocolError, decode_header, encode_frame
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.errors import KVStoreError, NotDurable
from kvstore.layout import KVLayout

log = logging.getLogger(__name__)

Transport = Literal["unix", "tcp"]
SHM_OPS = frozenset({Op.GET_SHM, Op.PUT_SHM_RESERVE, Op.PUT_SHM_COMMIT})


@dataclass
class SessionContext:
    """What every session shares: config, storage, metrics, the executor, and the stats callback."""

    daemon: DaemonConfig
    layout: KVLayout
    backend: DaemonBackend
    metrics: DaemonMetrics
    executor: Executor
    shm_name: str
    stats: Callable[[], Awaitable[dict[str, Any]]]


class Session:
    """Serves one connection; :attr:`busy` is true while a request is being executed."""

    def __init__(self, conn_id: int, transport: Transport, ctx: SessionContext) -> None:
        self.conn_id, self.transport, self.ctx = conn_id, transport, ctx
        self.hello: m.Hello | None = None
        self.shm = False
        self.observer = False
        self.busy = False
        self.writer: asyncio.StreamWriter | None = None
        self.flush_mark = 0  # FLUSH reports write failures after this mark: since start, then since the last FLUSH

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Run the request loop until the peer closes, breaks the protocol fatally, or the daemon stops."""
        self.writer = writer
        met = self.ctx.metrics
        met.clients += 1
        met.connections += 1
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            log.debug("client %d (%s) vanished mid-request", self.conn_id, self.transport)
        finally:
            met.clients -= 1
            writer.close()
            log.info("client %d (%s, %s) disconnected", self.conn_id, self.transport, self._name())

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read, run and answer one request; ``False`` ends the session."""
        try:
            raw = await reader.readexactly(HEADER_SIZE)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                log.debug("client %d closed mid-header (%d bytes)", self.conn_id, len(exc.partial))
            return False
        request_id = int.from_bytes(raw[8:12], "little") if len(raw) >= 12 else 0
        try:
            header = decode_header(raw, int(self.ctx.daemon.max_frame_bytes))
        except ProtocolError as exc:
            await self._error(writer, request_id, exc)
            return False
        payload = await reader.readexactly(header.length)
        self.ctx.metrics.bytes_in += HEADER_SIZE + header.length
        start = time.perf_counter()
        self.busy = True
        try:
            reply = await self._handle(header.op, payload)
        except ProtocolError as exc:
            await self._error(writer, header.request_id, exc)
            return not exc.fatal
        except (KVStoreError, ValueError) as exc:
            await self._error(writer, header.request_id, ProtocolError(ErrorCode.INTERNAL, f"{header.op_name()}: {exc}"))
            return True
        finally:
            self.busy = False
        await self._send(writer, encode_frame(header.op | REPLY_BIT, header.request_id, reply))
        self.ctx.metrics.observe(Op(header.op).name, time.perf_counter() - start)
        return True

    async def _handle(self, op_num: int, payload: bytes) -> bytes:
        msg = m.decode_request(op_num, payload, self.ctx.layout.bytes_per_block)
        if self.hello is None:
            if not isinstance(msg, m.Hello):
                raise ProtocolError(ErrorCode.UNAUTHORIZED, f"{Op(op_num).name} before HELLO", fatal=True)
            return self._handshake(msg)
        if isinstance(msg, m.Hello):
            raise ProtocolError(ErrorCode.NOT_ALLOWED, "HELLO: the connection is already handshaken")
        op = Op.PUT_INLINE if isinstance(msg, m.PutInline) else msg.op
        if self.observer and op != Op.STATS:
            raise ProtocolError(ErrorCode.NOT_ALLOWED, f"{op.name}: an observer connection (zero fingerprint) may only ask STATS")
        if op in SHM_OPS and not self.shm:
            raise ProtocolError(ErrorCode.NOT_ALLOWED, f"{op.name}: shared memory is only for local clients that asked for it")
        return await self._run(self._dispatch, msg)

    def _handshake(self, hello: m.Hello) -> bytes:
        cfg, layout = self.ctx.daemon, self.ctx.layout
        known = [t for t in [cfg.token, *cfg.tenant_salts] if t]
        token_ok = hello.token is not None and any(hmac.compare_digest(hello.token.encode(), t.encode()) for t in known)
        if (self.transport == "tcp" or hello.token is not None) and not token_ok:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "HELLO: missing or wrong token", fatal=True)
        self.observer = hello.fingerprint == OBSERVER_FINGERPRINT
        if hello.fingerprint != layout.fingerprint and not self.observer:
            raise ProtocolError(
                ErrorCode.BAD_LAYOUT,
                f"HELLO: layout fingerprint {hello.fingerprint.hex()} differs from the daemon's "
                f"{layout.fingerprint.hex()} (model {layout.model_id!r})",
                fatal=True,
            )
        self.hello = hello
        self.shm = hello.want_shm and self.transport == "unix" and not self.observer
        salt = cfg.tenant_salts.get(hello.token) if hello.token else None
        log.info("client %d (%s, %s) connected, shm=%s, tenant salt %s",
                 self.conn_id, self.transport, self._name(), self.shm, "set" if salt else "none")
        host = self.ctx.backend.host
        return m.encode_hello_reply(m.HelloReply(
            salt.encode() if salt else None, self.ctx.shm_name if self.shm else None,
            layout.bytes_per_block, host.num_slots, cfg.lease_timeout_s, int(cfg.max_frame_bytes),
        ))

    async def _run(self, fn: Callable[[m.Request], bytes], msg: m.Request) -> bytes:
        if isinstance(msg, m.EmptyRequest) and msg.op == Op.STATS:
            return m.encode_json(await self.ctx.stats())
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.ctx.executor, fn, msg)

    def _dispatch(self, msg: m.Request) -> bytes:
        """Run one request against the backend (on an executor thread); returns the reply payload."""
        b, me = self.ctx.backend, self.conn_id
        if isinstance(msg, m.PutInline):
            return m.encode_flags(b.put_inline(msg.keys, msg.blocks))
        if isinstance(msg, m.EmptyRequest):
            try:
                self.flush_mark = b.flush(self.flush_mark)
            except NotDurable as exc:
                self.flush_mark = exc.total  # reported to this connection once
                raise ProtocolError(ErrorCode.NOT_DURABLE, m.encode_not_durable(exc)) from None
            return b""
        assert isinstance(msg, m.KeysRequest)
        keys, op = msg.keys, msg.op
        if op == Op.EXISTS_PREFIX:
            return m.encode_count(b.exists_prefix(keys))
        if op == Op.GET_SHM:
            return m.encode_slots([(0, None) if s is None else (1, s) for s in b.lease_get(me, keys)])
        if op == Op.GET_INLINE:
            return m.encode_blocks(b.read_inline(keys))
        if op == Op.PUT_SHM_RESERVE:
            return m.encode_slots([(int(st), s) for st, s in b.reserve(me, keys)])
        if op == Op.PUT_SHM_COMMIT:
            return m.encode_flags(b.commit(me, keys))
        if op == Op.RELEASE:
            return m.encode_count(b.release(me, keys))
        return m.encode_count(b.delete(keys))

    async def _error(self, writer: asyncio.StreamWriter, request_id: int, exc: ProtocolError) -> None:
        self.ctx.metrics.error(exc.code.name)
        log.warning("client %d (%s): %s%s", self.conn_id, self.transport, exc, " (closing)" if exc.fatal else "")
        try:
            await self._send(writer, encode_frame(Op.ERROR, request_id, m.encode_error(exc.code, exc.message)))
        except ConnectionError:
            pass  # the peer is gone already

    async def _send(self, writer: asyncio.StreamWriter, frame: bytes) -> None:
        writer.write(frame)
        await writer.drain()
        self.ctx.metrics.bytes_out += len(frame)

    def _name(self) -> str:
        return self.hello.client_name if self.hello is not None and self.hello.client_name else "unnamed"
