"""Real ``kvstore engine serve`` replicas and a ``kvstore route`` router on loopback ports, for end-to-end tests.

Every process is started with port 0 and announces where it listens on its
first stdout line; the fleet reads those lines (with a deadline) and keeps
the addresses, so a replica can be restarted on the same ports. A
:class:`Forwarder` can sit between a replica's event stream and the router
and drop batches on demand (lost events, a stale index).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

BANNER_TIMEOUT_S = 120.0


class Proc:
    """A child process whose stdout lines are read on a thread."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen([sys.executable, "-m", "kvstore", *args], cwd=cwd, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.output.append(line)
            self.lines.put(line)

    def banner(self, pattern: str) -> re.Match[str]:
        """The first output line matching ``pattern``; fails with the output if the process exits or times out."""
        deadline = time.monotonic() + BANNER_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
                continue
            m = re.search(pattern, line)
            if m:
                return m
        self.stop()
        raise AssertionError(f"no line matching {pattern!r}; output:\n{''.join(self.output)}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` and wait for the exit."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@dataclass
class Replica:
    """One engine replica and the addresses it bound."""

    name: str
    proc: Proc
    url: str
    events: str
    replay: str


_REPLICA_LINE = (r"listening on (?P<url>http://[\d.:]+); KV events on (?P<events>tcp://[\d.:]+), "
                 r"replay on (?P<replay>tcp://[\d.:]+)")


def _args(name: str, block_size: int, config: Path, port: str, events: str, replay: str) -> list[str]:
    return ["engine", "serve", "--model", "builtin", "--block-size", str(block_size), "--num-blocks", "256",
            "--port", port, "--config", str(config), "--replica-id", name, "--events-endpoint", events,
            "--replay-endpoint", replay]


def _replica(name: str, proc: Proc) -> Replica:
    m = proc.banner(_REPLICA_LINE)
    return Replica(name, proc, m["url"], m["events"], m["replay"])


def start_replicas(names: list[str], cwd: Path, block_size: int, configs: dict[str, Path]) -> list[Replica]:
    """Start every replica at once on free ports (they load in parallel), then wait for each."""
    any_port = "tcp://127.0.0.1:0"
    procs = [Proc(_args(n, block_size, configs[n], "0", any_port, any_port), cwd) for n in names]
    return [_replica(name, proc) for name, proc in zip(names, procs)]


def restart_replica(old: Replica, cwd: Path, block_size: int, config: Path) -> Replica:
    """Start ``old`` again (after it stopped) on the same HTTP, events and replay addresses."""
    port = old.url.rsplit(":", 1)[1]
    return _replica(old.name, Proc(_args(old.name, block_size, config, port, old.events, old.replay), cwd))


class Forwarder:
    """Relays one replica's event stream to the router (SUB -> PUB on a thread); drops batches when told."""

    def __init__(self, source: str) -> None:
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(source)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self._to_drop = 0
        self.dropped: list[int] = []
        """Seqs of the batches dropped so far."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def drop_next(self, n: int) -> None:
        """Drop the next ``n`` batches."""
        with self._lock:
            self._to_drop += n

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            frames = self._sub.recv_multipart()
            with self._lock:
                drop = self._to_drop > 0
                if drop:
                    self._to_drop -= 1
                    self.dropped.append(int.from_bytes(frames[1], "big"))
            if not drop:
                self._pub.send_multipart(frames)

    def close(self) -> None:
        """Stop relaying and close both sockets."""
        self._stop.set()
        self._thread.join()
        self._sub.close(linger=0)
        self._pub.close(linger=0)


def start_router(cwd: Path, replicas: list[Replica], events: dict[str, str], poll_interval: float) -> tuple[Proc, str]:
    """Start ``kvstore route`` over ``replicas`` (their events from ``events[name]``); returns it and its URL."""
    args = ["route", "--model", "builtin", "--port", "0", "--poll-interval", str(poll_interval)]
    for r in replicas:
        args += ["--replica", f"{r.url},events={events[r.name]},replay={r.replay},name={r.name}"]
    proc = Proc(args, cwd)
    return proc, proc.banner(r"behind (?P<url>http://[\d.:]+)")["url"]
