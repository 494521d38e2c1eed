"""Start and stop throwaway ``redis-server`` (or ``valkey-server``) processes on loopback ports (tests and
``python -m benchmarks remote``).

Each server runs in the foreground of its own process with a pidfile in its directory and is
stopped by that pid (never by name). A cluster is six such servers made into three primaries with
a replica each by ``redis-cli --cluster create``; its ``cluster-node-timeout`` is small so a
failover takes about a second. Valkey takes the same arguments (:data:`VALKEY`); with a TLS
directory (:func:`make_tls_files`) a server, or a whole cluster (bus and replication too), speaks TLS only.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ServerBinaries:
    """The server and command-line programs of one Redis-protocol implementation."""

    server: str
    cli: str
    packages: str
    """The Debian packages that install them (named when they are missing)."""


REDIS = ServerBinaries("redis-server", "redis-cli", "redis-server, redis-tools")
VALKEY = ServerBinaries("valkey-server", "valkey-cli", "valkey-server, valkey-tools from bookworm-backports")


def redis_missing(binaries: ServerBinaries = REDIS) -> str | None:
    """Why real servers of ``binaries`` cannot be started here (``None`` when they can)."""
    missing = [b for b in (binaries.server, binaries.cli) if shutil.which(b) is None]
    if missing:
        return (f"{' and '.join(missing)} not on PATH (Debian packages {binaries.packages}; "
                "`make test` installs them with apt when run as root, scripts/ensure_redis.sh)")
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the Python package redis (redis-py) is not installed (pip install -e .)"
    return None


def free_port(cluster: bool = False) -> int:
    """A loopback TCP port free now (and, for a cluster node, its bus port ``port + 10000`` too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster:
            return port
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no free loopback port found")


@dataclass
class RedisServer:
    """One ``redis-server`` process."""

    port: int
    dir: Path
    proc: subprocess.Popen[bytes]
    password: str | None = None
    tls_dir: Path | None = None
    """Directory of ``ca.crt``, ``server.crt`` and ``server.key`` when the server speaks TLS only."""
    binaries: ServerBinaries = REDIS

    @property
    def pidfile(self) -> Path:
        """The server's pidfile."""
        return self.dir / "redis.pid"

    @property
    def pid(self) -> int:
        """The pid from the pidfile (the process's own pid until the server has written it)."""
        try:
            return int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return self.proc.pid

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:port/0``."""
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls_dir else 'redis'}://{auth}127.0.0.1:{self.port}/0"

    def cli(self, *args: str) -> str:
        """Run ``redis-cli`` against this server; returns its stdout."""
        cmd = [self.binaries.cli, "-h", "127.0.0.1", "-p", str(self.port)]
        if self.password:
            cmd += ["--no-auth-warning", "-a", self.password]
        if self.tls_dir:
            cmd += ["--tls", "--cacert", str(self.tls_dir / "ca.crt")]
        return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=10, check=True).stdout

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (a crash), by its pid."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM the server by its pid and wait for it (SIGKILL after 10 s)."""
        if not self.alive():
            return
        os.kill(self.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()


def start_server(dir: Path, port: int | None = None, *, maxmemory: str | None = None,
                 policy: str = "allkeys-lru", notify: str = "Exe", password: str | None = None,
                 cluster_node_timeout_ms: int | None = None, tls_dir: Path | None = None,
                 extra: tuple[str, ...] = (), binaries: ServerBinaries = REDIS) -> RedisServer:
    """Start ``binaries.server`` on ``127.0.0.1:port`` (a free one by default) with no persistence; waits for PING.

    With ``tls_dir`` (see :func:`make_tls_files`) the port speaks TLS only (in a cluster, the bus and
    replication links too)."""
    port = port or free_port(cluster=cluster_node_timeout_ms is not None)
    dir.mkdir(parents=True, exist_ok=True)
    args = [binaries.server, "--port", str(port), "--bind", "127.0.0.1", "--daemonize", "no",
            "--pidfile", str(dir / "redis.pid"), "--dir", str(dir), "--logfile", str(dir / "redis.log"),
            "--save", "", "--appendonly", "no", "--maxmemory-policy", policy,
            "--notify-keyspace-events", notify]
    if maxmemory:
        args += ["--maxmemory", maxmemory]
    if password:
        args += ["--requirepass", password, "--masterauth", password]
    if cluster_node_timeout_ms is not None:
        args += ["--cluster-enabled", "yes", "--cluster-config-file", str(dir / "nodes.conf"),
                 "--cluster-node-timeout", str(cluster_node_timeout_ms),
                 # a replica may always take over (the default refuses one disconnected for 10 node timeouts)
                 "--cluster-replica-validity-factor", "0", "--repl-diskless-sync-delay", "0"]
    if tls_dir is not None:
        args[1:3] = ["--port", "0", "--tls-port", str(port)]
        args += ["--tls-cert-file", str(tls_dir / "server.crt"), "--tls-key-file", str(tls_dir / "server.key"),
                 "--tls-ca-cert-file", str(tls_dir / "ca.crt"), "--tls-auth-clients", "no"]
        if cluster_node_timeout_ms is not None:
            # the bus and replication links are TLS too; nodes authenticate each other with the same cert
            args += ["--tls-cluster", "yes", "--tls-replication", "yes",
                     "--tls-client-cert-file", str(tls_dir / "server.crt"),
                     "--tls-client-key-file", str(tls_dir / "server.key")]
    args += list(extra)
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server = RedisServer(port, dir, proc, password, tls_dir, binaries)
    _wait(lambda: server.cli("PING").strip() == "PONG", 10, f"redis-server on port {port} (log {dir}/redis.log)",
          server)
    return server


def make_tls_files(dir: Path) -> Path:
    """A throwaway CA and a server certificate for 127.0.0.1 (``openssl``) in ``dir``; returns ``dir``."""
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
         "-subj", "/CN=kvstore-test-ca"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
         "server.crt", "-days", "2", "-extfile", "san.cnf"],
    ]
    for step in steps:
        subprocess.run(["openssl", *step], cwd=dir, capture_output=True, check=True, timeout=60)
    return dir


@dataclass
class RedisClusterProcs:
    """A Redis Cluster of local ``redis-server`` processes (three primaries with one replica each)."""

    servers: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """``redis-cluster://127.0.0.1:p1,...`` (``rediss-cluster://`` under TLS) naming every node as a seed."""
        tls = bool(self.servers) and self.servers[0].tls_dir is not None
        return f"{'rediss' if tls else 'redis'}-cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def roles(self) -> dict[int, str]:
        """``{port: "master" | "slave"}`` of the running nodes (from ``ROLE``)."""
        out = {}
        for s in self.servers:
            if s.alive():
                try:
                    out[s.port] = s.cli("ROLE").split()[0]
                except (subprocess.SubprocessError, IndexError):
                    pass
        return out

    def masters(self) -> list[RedisServer]:
        """Running nodes that are primaries now."""
        roles = self.roles()
        return [s for s in self.servers if roles.get(s.port) == "master"]

    def healthy(self) -> bool:
        """Whether every running node reports ``cluster_state:ok``, three primaries run, and every running
        replica's link to its primary is up (synchronised, so it can take over)."""
        try:
            up = [s for s in self.servers if s.alive()]
            ok = all("cluster_state:ok" in s.cli("CLUSTER", "INFO") for s in up)
            roles = self.roles()
            linked = all("master_link_status:up" in s.cli("INFO", "replication") for s in up
                         if roles.get(s.port) == "slave")
        except subprocess.SubprocessError:
            return False
        return ok and linked and len(self.masters()) == 3

    def wait_healthy(self, timeout: float = 30) -> None:
        """Wait until :meth:`healthy` (raises ``TimeoutError``)."""
        _wait(self.healthy, timeout, "the Redis cluster to report cluster_state:ok")

    def flush(self) -> None:
        """FLUSHALL on every primary."""
        for s in self.masters():
            s.cli("FLUSHALL")

    def stop(self) -> None:
        """Stop every node by its pid."""
        for s in self.servers:
            s.stop()


def start_cluster(dir: Path, node_timeout_ms: int = 500, maxmemory: str | None = None,
                  binaries: ServerBinaries = REDIS, tls_dir: Path | None = None) -> RedisClusterProcs:
    """Six nodes, ``redis-cli --cluster create ... --cluster-replicas 1``, waited until healthy (TLS only,
    client, bus and replication, with ``tls_dir``)."""
    cluster = RedisClusterProcs()
    try:
        for i in range(6):
            cluster.servers.append(start_server(dir / f"node{i}", maxmemory=maxmemory, binaries=binaries,
                                                cluster_node_timeout_ms=node_timeout_ms, tls_dir=tls_dir))
        tls = ["--tls", "--cacert", str(tls_dir / "ca.crt")] if tls_dir is not None else []
        subprocess.run([binaries.cli, *tls, "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in cluster.servers],
                        "--cluster-replicas", "1", "--cluster-yes"], capture_output=True, text=True, timeout=60,
                       check=True)
        cluster.wait_healthy()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait(cond: object, timeout: float, what: str, server: RedisServer | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and not server.alive():
            raise RuntimeError(f"{what} exited at start (code {server.proc.returncode})")
        try:
            if cond():  # type: ignore[operator]
                return
        except subprocess.SubprocessError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"waited {timeout:.0f} s for {what}")
