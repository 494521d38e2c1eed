"""``kvstore bench soak``: a bounded reliability run with ``kill -9`` of clients and of the daemon.

It starts a real ``kvstore serve`` on a small config in a temporary
directory and several client processes (:mod:`kvstore.bench.soak_client`)
that put blocks whose bytes derive from their keys, FLUSH, and read earlier
blocks back checking every byte. At random moments it kills a client
(``kill -9``, then starts a new one) or the daemon (``kill -9``, then
restarts it on the same data directory). It ends in three steps::

    kill -9 every client at once ─► STATS now, and after the hold deadline (holds, reserved slots)
    kill -9 the daemon, restart it ─► read every acknowledged block back (lost? wrong bytes?)
    SIGTERM the daemon ─► its exit code

With ``--tenants N`` the daemon has N tenants (``daemon.tenant_salts``) and
the clients take turns among N+1 identities: untenanted local clients and
each tenant (:func:`~kvstore.bench.soak_blocks.identity`). Every client also
asks for other identities' blocks, and the final check reads each identity's
blocks as that identity and a sample of the others' blocks, which must miss.

It reports lost acknowledged blocks, wrong bytes served and blocks served
across identities (all must be 0), the daemon's memory growth per minute, holds and reserved slots left
by dead clients, and counts of operations, kills and restarts. Temporary
files and every child process are removed on exit, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import math
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from kvstore.bench.harness import Progress, SuiteError, SuiteOptions
from kvstore.bench.soak_blocks import block_bytes, identity, read_journals, tenant_salt, tenant_token
from kvstore.bench.soak_client import STOP_PUTS, connect
from kvstore.bench.soak_procs import RssSample, SoakProcs, read_rss, wait_until
from kvstore.bench.soak_report import HoldCheck, Marker, SoakRecord, SoakResults, plot, report
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.client.tier import DaemonTier
from kvstore.errors import KVStoreError
from kvstore.util.interrupts import sigterm_raises

__all__ = ["SoakPlan", "plot", "run"]

MODEL = {"model_id": "soak", "num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "block_size": 8, "dtype": "float16"}
"""A small layout: 4 KiB blocks."""
SAMPLE_S = 0.5
"""Seconds between daemon RSS samples."""
STATS_S = 1.0
"""Seconds between daemon STATS reads (disk fill, evictions, write failures)."""
CLIENT_START_S = 120.0
"""Longest wait for the first clients to connect before the clock starts."""
FREEZE_TRIES = 40
"""Attempts at catching the clients with a host slot hold before the final kill."""
PUTS_STOP_FILL = 0.7
"""Disk-tier fill at which clients stop putting, so nothing acknowledged is ever evicted."""


@dataclass(frozen=True)
class SoakPlan:
    """The parameters of one soak run (recorded as the results' ``config``)."""

    minutes: float
    clients: int
    seed: int
    host_slots: int = 512
    """Host-tier slots: small, so blocks keep moving between host and disk (and host evictions happen)."""
    disk_mib: int = 1024
    """Disk-tier cap (``disk.max_size``)."""
    hold_timeout_s: float = 4.0
    """``daemon.hold_timeout_s``: how long the hold check waits for the deadline."""
    tenants: int = 0
    """Tenants in ``daemon.tenant_salts``; clients take turns among them and untenanted local clients."""

    @property
    def seconds(self) -> float:
        """Length of the main phase."""
        return self.minutes * 60

    def kills(self, rng: random.Random) -> list[Marker]:
        """When to kill what: at least one daemon kill (one per ~45 s, none after 70% of the run) and at least
        one client kill (one per <= 6 s on average)."""
        d = self.seconds
        n_daemon = max(1, round(d / 45))
        out = [Marker(min(0.7 * d, max(0.15 * d, d * (i + 0.5 + rng.uniform(-0.25, 0.25)) / n_daemon)), "daemon")
               for i in range(n_daemon)]
        every = min(6.0, d / 3)
        t = 0.1 * d + rng.expovariate(1 / every)
        clients = [Marker(0.1 * d + rng.uniform(0, 0.8 * d), "client")]
        while t < 0.95 * d:
            clients.append(Marker(t, "client"))
            t += rng.expovariate(1 / every)
        return sorted(out + (clients[1:] or clients), key=lambda m: m.t)

    def config(self, root: Path, data: Path) -> dict[str, Any]:
        """The daemon's YAML config: socket under ``root``, LMDB environment under ``data``."""
        bpb = SoakPlan.bytes_per_block()
        return {
            "model": dict(MODEL),
            "host": {"capacity": self.host_slots * bpb},
            "disk": {"path": str(data / "lmdb"), "max_size": f"{self.disk_mib}MiB", "sync": "interval"},
            "daemon": {"socket_path": str(root / "d.sock"), "hold_timeout_s": self.hold_timeout_s,
                       "layouts": "model",  # one layout: its host slots and holds are the ones checked
                       "tenant_salts": {tenant_token(k): tenant_salt(k) for k in range(1, self.tenants + 1)}},
            "metrics": {"enabled": False},
            "logging": {"level": "WARNING"},
        }

    @staticmethod
    def bytes_per_block() -> int:
        """Bytes of one block of :data:`MODEL`."""
        from kvstore.config.schema import ModelConfig

        return ModelConfig(**MODEL).layout().bytes_per_block


MAX_TMP_PATH = 48
"""Longest temporary-directory path the run directory goes under (room for ``/kvsoakXXXXXXXX/d.sock``)."""


def run(options: SuiteOptions, progress: Progress) -> SoakResults:
    """Run the soak (``options.minutes``, ``options.clients``, ``options.tenants``; ``quick``: 0.1 min, 2 clients)
    and report it."""
    plan = SoakPlan(minutes=options.minutes or (0.1 if options.quick else 2.0),
                    clients=options.clients or (2 if options.quick else 4), seed=options.seed,
                    hold_timeout_s=2.0 if options.quick else 4.0, tenants=options.tenants or 0)
    if plan.tenants >= plan.clients:
        raise SuiteError(f"--tenants {plan.tenants} needs more than {plan.tenants} --clients: clients take turns "
                         "among the untenanted identity and each tenant")
    record = SoakRecord()
    results = SoakResults(options, {**asdict(plan), "model": MODEL, "bytes_per_block": SoakPlan.bytes_per_block(),
                                    "puts_stop_fill": PUTS_STOP_FILL}, record)
    root = _run_root()
    data = root
    if options.data_dir is not None:
        options.data_dir.mkdir(parents=True, exist_ok=True)
        data = Path(tempfile.mkdtemp(prefix="kvsoak-data-", dir=options.data_dir))
    config = root / "daemon.yaml"
    config.write_text(yaml.safe_dump(plan.config(root, data)))
    procs = SoakProcs(config, root, options.seed, plan.tenants)
    with sigterm_raises():  # also set by the CLI; here for callers of run() outside it
        try:
            _Driver(plan, procs, record, progress, results).run()
        finally:
            with _signals_deferred():  # a Ctrl-C or SIGTERM now is handled after the cleanup, not in its middle
                procs.kill_all()
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(data, ignore_errors=True)
    report(results, record)
    if plan.tenants:
        results.note(f"Tenants: {plan.tenants} in daemon.tenant_salts; client i logs in as identity i mod "
                     f"{plan.tenants + 1} (0: untenanted, on the Unix socket). With tenants the host tier is the "
                     "daemon's private memory, so every client is served inline. served.foreign counts blocks of "
                     "another identity that were served (asked: how many were asked for).")
    return results


def _run_root() -> Path:
    """A fresh directory for the run's config, socket and journals: under the temporary directory
    (``$TMPDIR``) when its path is short, else under ``/tmp``: the daemon's socket lives here, and
    AF_UNIX socket paths are limited to ~107 bytes."""
    parent = tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="kvsoak", dir=parent if len(parent) <= MAX_TMP_PATH else "/tmp"))


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back while the block runs; they are delivered when it ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _Driver:
    """The run's main loop and its final checks (one use)."""

    def __init__(self, plan: SoakPlan, procs: SoakProcs, record: SoakRecord, progress: Progress,
                 results: SoakResults) -> None:
        self.plan, self.procs, self.record, self.progress, self.results = plan, procs, record, progress, results
        self.rng = random.Random(plan.seed)
        self.t0 = time.monotonic()
        self.observer: DaemonClient | None = None
        self.evictions: dict[int, int] = {}  # daemon pid -> disk evictions it reported
        self.write_failures: dict[int, int] = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        """Main phase, then the hold check, the final restart and check, and an orderly stop."""
        self.progress.grow(math.ceil(self.plan.seconds) + 3)
        for i in range(self.plan.clients):
            self.procs.start_client(i)  # they wait for the daemon; their imports overlap its start
        daemon = self.procs.start_daemon()
        self.observer = DaemonClient(None, socket_path=daemon.socket_path, timeout_s=10.0, backoff_max_s=0.5)
        if not wait_until(self.procs.clients_ready, CLIENT_START_S, 0.1):
            raise RuntimeError(f"soak clients did not connect within {CLIENT_START_S:.0f} s; "
                               f"client 0 log:\n{self.procs.client_log_tail(0)}")
        self.t0 = time.monotonic()
        stop = threading.Event()
        sampler = threading.Thread(target=self.sample_rss, args=(stop,), name="soak-rss", daemon=True)
        sampler.start()
        try:
            self.main_phase()
            self.record.duration_s = self.now()
            self.hold_check()
        finally:
            stop.set()
            sampler.join()
        self.progress.step("holds checked")
        self.verify_after_crash()
        self.progress.step("acknowledged blocks checked")
        self.observer.close()
        self.record.exit_code = self.procs.stop_daemon()
        self.progress.step("daemon stopped")

    # ---------------------------------------------------------- main phase
    def main_phase(self) -> None:
        events = self.plan.kills(self.rng)
        next_stats = 0.0
        shown = 0
        while (t := self.now()) < self.plan.seconds:
            while events and events[0].t <= t:
                self.kill(events.pop(0).kind)
            if t >= next_stats:
                self.read_stats(main_phase=True)
                next_stats = t + STATS_S
            self.restart_exited()
            if int(t) > shown and shown < math.ceil(self.plan.seconds):
                n = min(int(t), math.ceil(self.plan.seconds)) - shown
                shown += n
                self.progress.step(f"kills {self.record.client_kills} clients, {self.record.daemon_kills} daemon", n)
            time.sleep(0.05)
        self.progress.step("main phase done", math.ceil(self.plan.seconds) - shown)

    def kill(self, kind: str) -> None:
        self.record.markers.append(Marker(self.now(), kind))
        if kind == "daemon":
            self.procs.kill_daemon()
            self.record.daemon_kills += 1
            self.procs.start_daemon()
            self.record.daemon_restarts += 1
        else:
            index = self.rng.randrange(self.plan.clients)
            self.procs.kill_client(index)
            self.record.client_kills += 1
            self.procs.start_client(index)
            self.record.client_restarts += 1

    def sample_rss(self, stop: threading.Event) -> None:
        """Thread: append the current daemon's memory to the record every :data:`SAMPLE_S` until ``stop``."""
        while not stop.wait(SAMPLE_S):
            daemon = self.procs.daemon  # replaced (not changed) on a restart: a plain read is enough
            rss = read_rss(daemon.proc.pid) if daemon is not None else None
            if rss is not None:
                self.record.rss.append(RssSample(self.now(), daemon.proc.pid, *rss))  # type: ignore[union-attr]

    def stats(self) -> dict[str, Any] | None:
        """The daemon's STATS, ``None`` while it does not answer."""
        assert self.observer is not None
        try:
            return self.observer.stats()
        except KVStoreError:
            return None

    def read_stats(self, main_phase: bool = False) -> None:
        """Track disk evictions and write failures; in the main phase, stop the puts near the disk cap."""
        snap = self.stats()
        if snap is None:
            return
        pid = int(snap["daemon"]["pid"])
        disk = snap.get("disk") or {}
        self.evictions[pid] = max(self.evictions.get(pid, 0), int(disk.get("evictions", 0)))
        self.write_failures[pid] = max(self.write_failures.get(pid, 0), int(snap.get("write_failures", 0)))
        self.record.disk_evictions = sum(self.evictions.values())
        self.record.write_failures = sum(self.write_failures.values())
        cap = int(disk.get("capacity_bytes", 0))
        full = cap and int(disk.get("used_bytes", 0)) >= PUTS_STOP_FILL * cap
        if main_phase and full and self.record.puts_stopped_at_s is None:
            (self.procs.directory / STOP_PUTS).touch()
            self.record.puts_stopped_at_s = self.now()

    def restart_exited(self) -> None:
        """Restart clients and a daemon that exited on their own, counting each as a crash."""
        for index, rc in self.procs.exited_clients():
            self.record.client_crashes += 1
            if self.record.client_crashes <= 2:
                self.results.note(f"client {index} exited by itself (status {rc}):\n"
                                  f"{self.procs.client_log_tail(index)}")
            self.procs.start_client(index)
            self.record.client_restarts += 1
        daemon = self.procs.daemon
        if daemon is not None and daemon.proc.poll() is not None:
            self.record.daemon_crashes += 1
            self.results.note(f"the daemon exited by itself (status {daemon.proc.returncode}):\n"
                              f"{self.procs.daemon_log_tail()}")
            self.procs.start_daemon()
            self.record.daemon_restarts += 1

    # -------------------------------------------------------- final checks
    def hold_check(self) -> None:
        """Kill every client at once while they have holds; read holds and reserved slots now and after the deadline.

        To kill them mid-operation rather than between requests, the clients are
        frozen (SIGSTOP) at random moments until STATS shows them with a hold
        or a reserved slot (at most :data:`FREEZE_TRIES` tries), then killed.
        """
        clients = list(self.procs.clients.values())
        check = HoldCheck()
        # after a late daemon restart the clients may still be reconnecting: wait until all of them are back
        wait_until(lambda: (s := self.stats()) is not None and int(s["daemon"]["clients"]) > len(clients),
                   CLIENT_START_S, 0.1)
        time.sleep(0.5)
        for attempt in range(1, FREEZE_TRIES + 1):
            for proc in clients:
                proc.send_signal(signal.SIGSTOP)
            time.sleep(0.05)  # let the daemon answer what the frozen clients had sent
            check.holds_at_kill, check.reserved_at_kill = self.held()
            check.freeze_tries = attempt
            if check.holds_at_kill > 0 or check.reserved_at_kill > 0:
                break
            for proc in clients:
                proc.send_signal(signal.SIGCONT)
            time.sleep(self.rng.uniform(0.0, 0.05))
        killed_at = time.monotonic()
        for proc in clients:
            proc.kill()
        for index in list(self.procs.clients):
            self.procs.kill_client(index)  # reaps
        self.record.client_kills += len(clients)
        self.record.markers.append(Marker(self.now(), "client"))
        # "immediately": once the daemon has seen the connections end (the observer's is the one left)
        wait_until(lambda: (s := self.stats()) is not None and int(s["daemon"]["clients"]) <= 1, 5.0, 0.05)
        check.holds_now, check.reserved_now = self.held()
        check.seconds_to_now = time.monotonic() - killed_at
        deadline = killed_at + self.plan.hold_timeout_s + min(1.0, self.plan.hold_timeout_s / 4) + 0.5
        time.sleep(max(0.0, deadline - time.monotonic()))
        check.holds_after_deadline, check.reserved_after_deadline = self.held()
        check.seconds_to_deadline = time.monotonic() - killed_at
        self.record.holds = check

    def held(self) -> tuple[int, int]:
        """``(holds, reserved host slots)`` from STATS; reserved = slots in use that hold no published block."""
        snap = self.stats()
        if snap is None:
            return -1, -1
        host = snap["host"]
        bpb = int(snap["daemon"]["bytes_per_block"])
        return int(snap["holds"]), int(host["used_bytes"]) // bpb - int(host["num_blocks"])

    def verify_after_crash(self) -> None:
        """``kill -9`` the daemon, restart it on the same data, and read every acknowledged block back as the
        identity that stored it; each identity also asks for a sample of the others' blocks, which must miss."""
        self.read_stats()
        self.procs.kill_daemon()
        self.record.daemon_kills += 1
        self.record.markers.append(Marker(self.now(), "daemon"))
        self.procs.start_daemon()
        self.record.daemon_restarts += 1
        view = read_journals(self.procs.directory)
        self.record.counts = view.counts
        tenants = self.plan.tenants
        owned: dict[int, list[bytes]] = {}
        for client, keys in view.acked_by_client.items():
            owned.setdefault(identity(client, tenants), []).extend(keys)
        missing: list[bytes] = []
        for k in range(tenants + 1):
            tier = connect(self.procs.config, f"soak verifier {k}", tenant_token(k) if k else None)
            missing += self.check_blocks(tier, owned.get(k, []))
            others = [key for j, keys in owned.items() if j != k for key in keys]
            sample = self.rng.sample(others, min(len(others), 256))
            for start in range(0, len(sample), 64):
                keys = sample[start : start + 64]
                self.record.foreign_final += sum(tier.get(keys, [torch.empty(tier.layout.bytes_per_block,
                                                                              dtype=torch.uint8) for _ in keys]))
            self.record.foreign_checked += len(sample)
            tier.client.close()
        self.read_stats()
        self.record.acked = len(view.acked)
        self.record.lost = len(missing)

    def check_blocks(self, tier: DaemonTier, acked: list[bytes]) -> list[bytes]:
        """Read ``acked`` back through ``tier``, counting wrong bytes; the keys still missing on a second pass
        (so only a block that is really gone counts as lost)."""
        bpb = tier.layout.bytes_per_block
        missing: list[bytes] = []
        for attempt in range(2):
            todo, missing = (acked if attempt == 0 else missing), []
            for start in range(0, len(todo), 64):
                keys = todo[start : start + 64]
                dests = [torch.empty(bpb, dtype=torch.uint8) for _ in keys]
                for key, dest, hit in zip(keys, dests, tier.get(keys, dests)):
                    if not hit:
                        missing.append(key)
                    elif not (dest.numpy() == block_bytes(key, bpb)).all():
                        self.record.wrong_final += 1
        return missing
