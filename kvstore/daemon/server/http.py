"""A minimal HTTP/1.0 responder for ``GET /healthz`` and ``GET /metrics`` on asyncio streams.

Not a general web server: one request per connection, ``GET`` only, request
line and headers bounded (8 KiB, 64 lines, 5 s), then the connection closes.
That is all Prometheus and a health checker need, without a dependency.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvstore.util.prometheus import CONTENT_TYPE

log = logging.getLogger(__name__)

MAX_LINE = 8192
MAX_HEADERS = 64
READ_TIMEOUT_S = 5.0


class HttpEndpoints:
    """Serves ``/healthz`` (``healthy()`` → 200 ``ok`` or 503) and ``/metrics`` (``metrics()`` text)."""

    def __init__(self, healthy: Callable[[], bool], metrics: Callable[[], Awaitable[str]]) -> None:
        self._healthy = healthy
        self._metrics = metrics
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (0 picks a free port); returns the bound address."""
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_LINE)
        addr = self._server.sockets[0].getsockname()
        return str(addr[0]), int(addr[1])

    async def close(self) -> None:
        """Stop listening (requests in progress finish on their own)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, ctype, body = await asyncio.wait_for(self._respond(reader), READ_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.LimitOverrunError, ValueError, ConnectionError):
            status, ctype, body = "400 Bad Request", "text/plain", b"bad request\n"
        try:
            head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
        except ConnectionError:
            pass  # the scraper went away; nothing to answer
        finally:
            writer.close()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
        request = (await reader.readline()).decode("latin-1").split()
        for _ in range(MAX_HEADERS):
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
        else:
            return "431 Request Header Fields Too Large", "text/plain", b"too many headers\n"
        if len(request) < 2:
            return "400 Bad Request", "text/plain", b"bad request line\n"
        method, path = request[0], request[1].split("?", 1)[0]
        if method != "GET":
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if path == "/healthz":
            ok = self._healthy()
            return ("200 OK" if ok else "503 Service Unavailable"), "text/plain", (b"ok\n" if ok else b"stopping\n")
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE, (await self._metrics()).encode()
        return "404 Not Found", "text/plain", b"not found; try /healthz or /metrics\n"
