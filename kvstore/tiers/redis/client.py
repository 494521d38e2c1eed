"""Make a redis-py client from ``remote.url`` and the section's credentials and timeouts.

``redis://`` and ``rediss://`` (TLS) reach one server (redis-py's own URL parser, so a ``/db``,
``user:password@`` and query options work as documented there); ``redis-cluster://`` and
``rediss-cluster://`` take a comma-separated list of ``host:port`` seed nodes of a Redis Cluster.
Retries inside redis-py are off: the tier's :class:`~kvstore.tiers.redis.backoff.Backoff` decides when
to try again, so a call never waits longer than ``timeout_s`` per round trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvstore.config.remote import RemoteConfig


@dataclass(frozen=True)
class RedisTarget:
    """Where the remote tier's server is, parsed from ``remote.url`` (credentials not included)."""

    cluster: bool
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    """Seed nodes (one for a standalone server)."""

    def describe(self) -> str:
        """``redis-cluster://h1:p1,h2:p2`` without credentials, for logs and errors."""
        scheme = ("rediss" if self.tls else "redis") + ("-cluster" if self.cluster else "")
        return f"{scheme}://" + ",".join(f"{h}:{p}" for h, p in self.nodes)


def parse_target(url: str) -> tuple[RedisTarget, str | None, str | None]:
    """``(target, username, password)`` from ``url``; raises ``ValueError`` naming ``remote.url``."""
    scheme, rest = url.split("://", 1)
    user: str | None = None
    password: str | None = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        if ":" in cred:
            u, p = cred.split(":", 1)
            user, password = (unquote(u) or None), unquote(p)
        else:
            password = unquote(cred)
    hosts = rest.split("/", 1)[0].split("?", 1)[0]
    nodes: list[tuple[str, int]] = []
    for part in hosts.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"remote.url {url!r}: {part!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    cluster = scheme.endswith("-cluster")
    if not cluster and len(nodes) != 1:
        raise ValueError(f"remote.url {url!r}: a {scheme}:// URL names one server; use redis-cluster:// for several")
    return RedisTarget(cluster, scheme.startswith("rediss"), tuple(nodes)), user, password


def make_client(cfg: RemoteConfig) -> tuple[Any, RedisTarget]:
    """A connected-on-demand client (``redis.Redis`` or ``RedisCluster``) for ``cfg``, and its target."""
    target, user, password = parse_target(cfg.url)
    opts: dict[str, Any] = {
        "socket_timeout": cfg.timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "username": cfg.username or user,
        "password": cfg.password if cfg.password is not None else password,
        "retry": Retry(NoBackoff(), 0),
        "client_name": "kvstore",
    }
    if target.tls:
        opts["ssl"] = True
        if cfg.tls_ca_file:
            opts["ssl_ca_certs"] = cfg.tls_ca_file
    if target.cluster:
        nodes = [ClusterNode(h, p) for h, p in target.nodes]
        return RedisCluster(startup_nodes=nodes, require_full_coverage=False, **opts), target
    opts.pop("ssl", None)  # redis-py reads rediss:// as TLS itself
    return redis.Redis.from_url(cfg.url, **opts), target


def node_client(cfg: RemoteConfig, host: str, port: int) -> redis.Redis:
    """A plain client of one node (for keyspace notifications, which a cluster does not forward)."""
    target, user, password = parse_target(cfg.url)
    return redis.Redis(
        host=host, port=port, username=cfg.username or user,
        password=cfg.password if cfg.password is not None else password,
        socket_connect_timeout=cfg.connect_timeout_s, socket_timeout=None, ssl=target.tls,
        ssl_ca_certs=cfg.tls_ca_file if target.tls else None, retry=Retry(NoBackoff(), 0),
    )
