"""Processes of a soak run: the ``kvstore serve`` daemon and the client processes, started and killed.

Children run in their own session, so a Ctrl-C at the terminal reaches only
the driver, which then kills them itself (:meth:`SoakProcs.kill_all`).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

READY = re.compile(r"listening on unix:(\S+) ")
"""The line ``kvstore serve`` prints once it accepts connections."""


@dataclass(frozen=True)
class RssSample:
    """Daemon memory at one moment (``/proc/PID/status``), in bytes."""

    t: float
    """Seconds since the run started."""
    pid: int
    vm_rss: int
    """Resident set: private memory plus touched shared memory (the host arena) and file pages (LMDB's map)."""
    rss_anon: int
    """Private anonymous memory only: the heap, where a leak shows."""
    rss_file: int
    """File-backed pages mapped in: mostly LMDB's map of ``data.mdb`` (bounded by the disk cap)."""


def read_rss(pid: int) -> tuple[int, int, int] | None:
    """``(VmRSS, RssAnon, RssFile)`` of ``pid`` in bytes, ``None`` when it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)
           if k in ("VmRSS", "RssAnon", "RssFile")}
    if "VmRSS" not in kib:
        return None  # a zombie
    return kib["VmRSS"] * 1024, kib.get("RssAnon", 0) * 1024, kib.get("RssFile", 0) * 1024


@dataclass
class DaemonProc:
    """A running ``kvstore serve``."""

    proc: subprocess.Popen[bytes]
    socket_path: str


class SoakProcs:
    """Starts, kills and restarts the daemon and the clients of one run; owns every child process."""

    def __init__(self, config: Path, directory: Path, seed: int, tenants: int = 0) -> None:
        self.config, self.directory, self.seed, self.tenants = config, directory, seed, tenants
        self.daemon: DaemonProc | None = None
        self.daemon_starts = 0
        self.clients: dict[int, subprocess.Popen[bytes]] = {}
        self.incarnations: dict[int, int] = {}

    # ------------------------------------------------------------- daemon
    def start_daemon(self, timeout_s: float = 60.0) -> DaemonProc:
        """Start ``kvstore serve`` on the run's config and wait for its ready line; raises with its log."""
        log = self.directory / f"daemon-{self.daemon_starts}.log"
        self.daemon_starts += 1
        with open(log, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--config", str(self.config)],
                                    stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        line: list[bytes] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline() if proc.stdout else b""),
                                  daemon=True)
        reader.start()
        reader.join(timeout_s)
        match = READY.search(line[0].decode(errors="replace")) if line else None
        if match is None:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the daemon did not start (stdout {line!r}); its log {log}:\n{log.read_text()[-3000:]}")
        self.daemon = DaemonProc(proc, match.group(1))
        return self.daemon

    def kill_daemon(self) -> None:
        """``kill -9`` the daemon and reap it."""
        if self.daemon is not None:
            _kill(self.daemon.proc)

    def stop_daemon(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the daemon (an orderly stop: flush, unlink) and return its exit code (``None``: it hung, killed)."""
        assert self.daemon is not None
        self.daemon.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.daemon.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _kill(self.daemon.proc)
            return None
        if self.daemon.proc.stdout is not None:
            self.daemon.proc.stdout.close()
        return rc

    def daemon_log_tail(self, n: int = 2000) -> str:
        """The end of the newest daemon log."""
        logs = sorted(self.directory.glob("daemon-*.log"), key=lambda p: p.stat().st_mtime)
        return logs[-1].read_text(errors="replace")[-n:] if logs else ""

    # ------------------------------------------------------------ clients
    def start_client(self, index: int) -> None:
        """Start a new incarnation of client ``index`` (its previous one must be dead)."""
        inc = self.incarnations.get(index, -1) + 1
        self.incarnations[index] = inc
        err = open(self.directory / f"client-{index}-{inc}.log", "wb")
        self.clients[index] = subprocess.Popen(
            [sys.executable, "-m", "kvstore.bench.soak_client", str(self.config), str(self.directory),
             str(index), str(inc), str(self.seed), "--tenants", str(self.tenants)], stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
        err.close()

    def clients_ready(self) -> bool:
        """Whether every client's current incarnation has connected (its journal has a line)."""
        for index, inc in self.incarnations.items():
            path = self.directory / f"journal-{index}-{inc}.jsonl"
            if not path.exists() or path.stat().st_size == 0:
                return False
        return True

    def kill_client(self, index: int) -> None:
        """``kill -9`` client ``index`` and reap it."""
        _kill(self.clients[index])

    def exited_clients(self) -> list[tuple[int, int]]:
        """``(index, returncode)`` of clients that ended on their own (a soak client only ends by a kill)."""
        return [(i, p.returncode) for i, p in self.clients.items() if p.poll() is not None]

    def client_log_tail(self, index: int, n: int = 2000) -> str:
        """The end of the log of client ``index``'s current incarnation."""
        path = self.directory / f"client-{index}-{self.incarnations[index]}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    # ------------------------------------------------------------ cleanup
    def kill_all(self) -> None:
        """``kill -9`` every child still running (a killed daemon's arena goes with it: nothing to clean up)."""
        for proc in self.clients.values():
            _kill(proc)
        self.kill_daemon()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def wait_until(predicate: Callable[[], bool], timeout_s: float, period_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(period_s)
    return True
