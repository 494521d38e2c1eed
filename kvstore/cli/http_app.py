"""Run an aiohttp application until interrupted: what ``kvstore engine serve`` and ``kvstore route`` share."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

from aiohttp import web


def run_app(app: web.Application, host: str, port: int, banner: Callable[[int], str],
            on_start: Callable[[], Awaitable[None]] | None = None) -> None:
    """Listen on ``host:port`` (port 0: any free one), print ``banner(port)`` to stdout, serve until interrupted.

    ``on_start`` runs in the event loop before listening (the router starts its
    health polling there). Ctrl-C / SIGTERM end it with ``KeyboardInterrupt``,
    after the server stopped listening; the caller's ``finally`` closes the rest.
    """

    async def serve() -> None:
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        try:
            if on_start is not None:
                await on_start()
            site = web.TCPSite(runner, host, port)
            await site.start()
            bound = runner.addresses[0][1]
            print(banner(bound), flush=True)
            await asyncio.Event().wait()  # until cancelled by the interrupt
        finally:
            await runner.cleanup()

    try:
        asyncio.run(serve())
    except OSError as exc:  # the port is taken, the host is not ours
        print(f"error: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
