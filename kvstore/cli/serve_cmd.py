"""``kvstore serve``: run the sidecar daemon on a config until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from kvstore.config.schema import KVStoreConfig

log = logging.getLogger("kvstore.serve")
EXIT_NOT_DURABLE = 3
"""Exit status when the daemon stopped but blocks it had acknowledged could not be written to disk."""


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def _setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


async def _serve(cfg: KVStoreConfig, config_name: str) -> int:
    import asyncio

    from kvstore.daemon.server.daemon import DaemonServer

    server = DaemonServer(cfg, config_source=config_name)
    info = await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop)
    metrics = f"{info.metrics_url}/metrics" if info.metrics_url else "off"
    events = f"{info.events} (replay {info.events_replay or 'off'})" if info.events else "off"
    print(
        f"kvstore serve: listening on unix:{info.socket_path} (mode 0600); tcp: {info.tcp or 'off'}; "
        f"metrics: {metrics}; shm: {info.shm_name + ' (sealed memfd, passed to local clients at login)' if info.shm_name else 'off (tenants configured: private memory)'}; config: {config_name}; kv events: {events}",
        flush=True,
    )
    log.info("serving with config %s", config_name)
    await server.wait_stopped()
    if server.durability_error is not None:
        print(f"error: kvstore serve stopped, but acknowledged data is not durable: {server.durability_error}",
              file=sys.stderr)
        return EXIT_NOT_DURABLE
    return 0


def _run(args: argparse.Namespace) -> int:
    from kvstore.config import ConfigError, load_config  # here, not at the top: pydantic costs `kvstore --help` ~0.3 s
    from kvstore.config.events import events_override
    from kvstore.config.serve_checks import serve_problems
    from kvstore.config.units import decimal_size_notes

    try:
        cfg = load_config(args.config)
        if args.socket is not None:
            cfg.daemon.socket_path = args.socket
        if args.metrics_port is not None:
            cfg.metrics.port = args.metrics_port
        if args.events_endpoint is not None or args.replay_endpoint is not None:
            cfg.daemon.events = events_override(cfg.daemon.events, args.events_endpoint, args.replay_endpoint)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problems = serve_problems(cfg, args.config or "<built-in defaults>")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 2
    for note in decimal_size_notes(cfg):
        print(f"note: {note}", file=sys.stderr)
    _setup_logging(args.log_level or cfg.logging.level, cfg.logging.format)
    import asyncio  # here, not at the top, like the config: `kvstore --help` must not pay for it

    try:
        from kvstore.config.loader import config_file

        source = config_file(args.config)  # named to clients whose layout it refuses, so absolute
        return asyncio.run(_serve(cfg, os.path.abspath(source) if source else "<built-in defaults>"))
    except (KVStoreError, OSError) as exc:
        print(f"error: cannot start the daemon: {exc}", file=sys.stderr)
        return 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` command."""
    parser = subparsers.add_parser(
        "serve",
        help="run the sidecar daemon: one host-RAM + NVMe cache shared by the engines on this host",
        description="Run kvstore as a long-lived daemon. It owns the host tier (an arena in POSIX shared memory) "
        "the disk tier (LMDB) and optionally a remote tier (Redis, shared with other hosts), serves engines on a Unix socket (mode 0600) and optionally TCP (token "
        "required), and exposes /healthz and Prometheus /metrics over HTTP. It prints one line saying where it "
        "listens, logs to stderr, and on SIGTERM stops accepting, flushes every acknowledged block to disk, "
        "removes its socket and shared memory, and exits 0 (3 when acknowledged blocks could not be written to disk, "
        "for example on a full filesystem; 1 when it cannot start, 2 for a bad config).",
    )
    parser.add_argument("--config", default=None, metavar="PATH",
                        help="YAML config; the model, host, disk, remote, daemon, metrics and logging sections apply "
                        "(default: $KVSTORE_CONFIG, else built-in defaults; KVSTORE_* environment overrides apply)")
    parser.add_argument("--socket", default=None, metavar="PATH",
                        help="Unix socket path, overriding daemon.socket_path (at most 107 bytes)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="N",
                        help="HTTP port of /healthz and /metrics, overriding metrics.port (0 picks a free port)")
    parser.add_argument("--events-endpoint", default=None, metavar="EP",
                        help="publish KV events of the daemon's tiers on this ZMQ address (tcp://HOST:PORT; port 0 "
                        "picks one), for `kvstore route --store`; turns daemon.events on and overrides its endpoint")
    parser.add_argument("--replay-endpoint", default=None, metavar="EP",
                        help="ZMQ address of the events' replay / full-report endpoint, overriding "
                        "daemon.events.replay_endpoint")
    parser.add_argument("--log-level", default=None, type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="lowest level logged to stderr, overriding logging.level (any case)")
    parser.set_defaults(func=_run)
