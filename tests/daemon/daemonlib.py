"""Helpers for daemon tests: a tmp config, the daemon as a subprocess, block data derived from keys."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from kvstore.config import load_config
from kvstore.daemon.wire import messages as m
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.wire.frames import ARENA_BYTE, HEADER, HEADER_SIZE, REPLY_BIT, ErrorCode, Op, encode_frame
from kvstore.daemon.client.tier import DaemonTier
from kvstore.layout import KVLayout

REPO = Path(__file__).resolve().parents[2]
MODEL = {"model_id": "daemon-test", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float16"}
LAYOUT = KVLayout(**MODEL)  # 512 bytes per block
READY = re.compile(r"listening on unix:(\S+) .*?tcp: (\S+?);.*?metrics: (\S+?);")


def short_tmpdir() -> Path:
    """A directory under /tmp with a short path (AF_UNIX paths are limited to ~107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="kvd", dir="/tmp"))


def write_config(root: Path, **over: Any) -> Path:
    """A daemon config under ``root``: tiny layout (``daemon.layouts: model``: the daemon serves it alone), 64 host
    slots, LMDB in ``root/lmdb``; ``over`` merges sections."""
    data: dict[str, Any] = {
        "model": dict(MODEL),
        "host": {"capacity": 64 * LAYOUT.bytes_per_block},
        "disk": {"path": str(root / "lmdb"), "max_size": "16MiB", "sync": "interval"},
        "daemon": {"socket_path": str(root / "d.sock"), "hold_timeout_s": 2.0, "layouts": "model"},
        "metrics": {"port": 0},
        "logging": {"level": "INFO"},
    }
    for section, values in over.items():
        data.setdefault(section, {}).update(values) if isinstance(values, dict) else data.__setitem__(section, values)
    path = root / "daemon.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@dataclass
class Daemon:
    """A running ``kvstore serve`` subprocess."""

    proc: subprocess.Popen[str]
    config: Path
    socket_path: str
    tcp: str | None
    metrics_url: str | None
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send ``sig`` and wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def tier(self, **client: Any) -> DaemonTier:
        """A connected :class:`DaemonTier` (``client`` goes to :class:`DaemonClient`)."""
        cfg = load_config(self.config)
        client.setdefault("token", cfg.daemon.token)
        c = DaemonClient(LAYOUT, socket_path=self.socket_path, **client)
        c.connect(10)
        return DaemonTier(LAYOUT, c)


def start_daemon(config: Path, timeout: float = 30.0, before: str | None = None, cwd: Path = REPO,
                 env: dict[str, str] | None = None) -> Daemon:
    """Start ``kvstore serve --config`` and wait for its "listening" line; raises with the log if it fails.

    ``before``: Python code the daemon process runs first (to inject a fault into a real daemon).
    ``cwd``: its working directory (relative paths in the config are relative to it); ``env``: added variables.
    """
    log = config.parent / f"daemon-{len(list(config.parent.glob('daemon-*.log')))}.log"
    err = open(log, "w")
    argv = ["-m", "kvstore", "serve", "--config", str(config)] if before is None else [
        "-c", f"{before}\nimport sys\nfrom kvstore.cli.main import main\nsys.exit(main(['serve', '--config', {str(config)!r}]))"]
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE, stderr=err, text=True, cwd=cwd, env={**os.environ, **(env or {})},
    )
    err.close()
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    reader.start()
    reader.join(timeout)
    match = READY.search(line[0]) if line else None
    if match is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"daemon did not start: stdout {line!r}, log:\n{log.read_text()}")
    tcp = None if match.group(2) == "off" else match.group(2)
    metrics = None if match.group(3) == "off" else match.group(3).removesuffix("/metrics")
    return Daemon(proc, config, match.group(1), tcp, metrics, log)


def cleanup(daemon: Daemon | None, root: Path) -> None:
    """Kill the daemon if it still runs and remove ``root``."""
    if daemon is not None and daemon.proc.poll() is None:
        daemon.proc.kill()
        daemon.proc.wait()
    shutil.rmtree(root, ignore_errors=True)


def block_for(key: bytes) -> torch.Tensor:
    """Deterministic block content derived from its key (so any reader can check it bit for bit)."""
    seed = hashlib.blake2b(key, digest_size=8).digest()
    return torch.frombuffer(bytearray(seed * (LAYOUT.bytes_per_block // 8)), dtype=torch.uint8).clone()


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    """``n`` distinct 32-byte keys."""
    return [hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=32).digest() for i in range(n)]


def assert_acknowledged_survive(tier: DaemonTier, attempted: list[list[bytes]], acked: list[bytes], what: str) -> None:
    """Read back every attempted key through ``tier`` (a restarted daemon): every block served has the bytes of
    its key, and every acknowledged key is served. ``what`` names the promise in the failure message."""
    everything = [k for ks in attempted for k in ks]
    dests = empty_blocks(len(everything))
    found = tier.get(everything, dests)
    for key, ok, dest in zip(everything, found, dests):
        if ok:
            assert torch.equal(dest, block_for(key)), f"block {key[:8].hex()} served with wrong bytes"
    present = {k for k, ok in zip(everything, found) if ok}
    missing = [k.hex()[:16] for k in acked if k not in present]
    assert not missing, f"{what}: {len(missing)} of {len(acked)} acknowledged blocks lost, e.g. {missing[:3]}"


def empty_blocks(n: int) -> list[torch.Tensor]:
    """``n`` destination buffers."""
    return [torch.zeros(LAYOUT.bytes_per_block, dtype=torch.uint8) for _ in range(n)]


def dev_shm() -> set[str]:
    """The names in ``/dev/shm`` (a daemon creates none: its arena is an unnamed memfd)."""
    return set(os.listdir("/dev/shm"))


def maps_arena(pid: int) -> bool:
    """Whether process ``pid`` maps a daemon's shared arena (a ``memfd:kvstore-...`` mapping)."""
    return "/memfd:kvstore-" in Path(f"/proc/{pid}/maps").read_text()


def signal_name(rc: int) -> str:
    """Readable exit status."""
    return signal.Signals(-rc).name if rc < 0 else str(rc)


def raw_unix(d: Daemon) -> socket.socket:
    """A plain socket connected to the daemon's Unix socket (nothing sent)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(d.socket_path)
    return s


def raw_tcp(d: Daemon, source: str | None = None) -> socket.socket:
    """A plain socket connected to the daemon's TCP port, from ``source`` (a loopback address) if given."""
    assert d.tcp is not None
    host, port = d.tcp.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0) if source else None)


def recv_exactly(s: socket.socket, n: int) -> bytes | None:
    """Exactly ``n`` bytes from ``s``, or ``None`` if the peer closed the connection first."""
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def read_reply(s: socket.socket) -> tuple[int, bytes] | None:
    """``(op, payload)`` of the next frame, or ``None`` if the daemon closed the connection."""
    head = recv_exactly(s, HEADER_SIZE)
    if head is None:
        return None
    _, _, op, _, length = HEADER.unpack(head)
    body = recv_exactly(s, length)
    return None if body is None else (op, body)


def raw_login(s: socket.socket, want_shm: bool = True, keep_arena: bool = False,
              layout: KVLayout | None = None) -> int | None:
    """Log a raw socket in without a token (a local client), asking for shared memory or not. The arena's
    descriptor that follows a reply granting it is read off the socket; returned with ``keep_arena``
    (the caller closes it), else closed. ``layout``: the daemon's, when not :data:`LAYOUT`."""
    fingerprint = (layout or LAYOUT).fingerprint
    s.sendall(encode_frame(Op.HELLO, 1, m.encode_hello(m.Hello(fingerprint, None, "raw", want_shm))))
    reply = read_reply(s)
    assert reply is not None and reply[0] == Op.HELLO | REPLY_BIT
    if m.decode_hello_reply(reply[1]).shm_name is None:
        return None
    data, fds, _, _ = socket.recv_fds(s, 1, 1)
    assert data == ARENA_BYTE and len(fds) == 1, (data, fds)
    if keep_arena:
        return fds[0]
    os.close(fds[0])
    return None


def raw_stats(s: socket.socket, rid: int) -> dict[str, Any]:
    """STATS on a raw socket; asserts the next frame is its reply (so nothing unasked came before it)."""
    s.sendall(encode_frame(Op.STATS, rid))
    reply = read_reply(s)
    assert reply is not None and reply[0] == Op.STATS | REPLY_BIT, reply
    return json.loads(reply[1])


def expect_error(s: socket.socket, code: ErrorCode, closed: bool) -> str:
    """Read an error reply with ``code`` (and then EOF when ``closed``); returns its message."""
    reply = read_reply(s)
    assert reply is not None and reply[0] == Op.ERROR, reply
    got, message = m.decode_error(reply[1])
    assert got == code, message
    assert (read_reply(s) is None) == closed
    return message


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss(pid: int) -> int:
    """Resident bytes of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def shipped_config(name: str, root: Path) -> Path:
    """``configs/<name>`` as shipped, with only its data path, socket and metrics port moved into ``root``."""
    data = yaml.safe_load((REPO / "configs" / name).read_text())
    data.setdefault("disk", {})["path"] = str(root / "lmdb")
    data.setdefault("daemon", {})["socket_path"] = str(root / "d.sock")
    data.setdefault("metrics", {})["port"] = 0
    path = root / name
    path.write_text(yaml.safe_dump(data))
    return path


def layout_tier(d: Daemon, layout: KVLayout, name: str = "test", **client: Any) -> DaemonTier:
    """A connected :class:`DaemonTier` for ``layout`` (a daemon serving any layout; ``client``: to the client)."""
    c = DaemonClient(layout, socket_path=d.socket_path, client_name=name, **client)
    c.connect(10)
    return DaemonTier(layout, c)


def layout_block(layout: KVLayout, key: bytes) -> torch.Tensor:
    """``key``'s block of ``layout``: bytes derived from both, so one layout's block never passes for another's."""
    seed = hashlib.blake2b(key + layout.fingerprint, digest_size=8).digest()
    n = layout.bytes_per_block
    return torch.frombuffer(bytearray((seed * (n // 8 + 1))[:n]), dtype=torch.uint8).clone()


def put_layout(tier: DaemonTier, layout: KVLayout, keys: list[bytes]) -> list[bool]:
    """Store ``keys``' blocks of ``layout`` (:func:`layout_block`)."""
    return tier.put(keys, [layout_block(layout, k) for k in keys])


def read_layout(tier: DaemonTier, layout: KVLayout, keys: list[bytes]) -> list[bool]:
    """Which of ``keys`` are served, each checked bit for bit against :func:`layout_block`."""
    dests = [torch.empty(layout.bytes_per_block, dtype=torch.uint8) for _ in keys]
    found = tier.get(keys, dests)
    for key, ok, dest in zip(keys, found, dests):
        if ok:
            assert torch.equal(dest, layout_block(layout, key)), f"{layout.model_id}: wrong bytes for {key.hex()[:8]}"
    return found


def observer_stats(d: Daemon) -> dict[str, Any]:
    """The daemon's STATS, asked by an observer connection (no layout, no shared memory)."""
    watcher = DaemonClient(None, socket_path=d.socket_path, use_shm=False)
    try:
        return watcher.stats()
    finally:
        watcher.close()
