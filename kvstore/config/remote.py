"""The ``remote:`` section: a tier on Redis or Valkey shared by every engine of a fleet."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kvstore.config.section import Section
from kvstore.config.units import PositiveSize
from kvstore.config.write_policy import SELECTIVE_HITS_DEFAULT, WritePolicy

REMOTE_SCHEMES = ("redis", "rediss", "redis-cluster", "rediss-cluster")
"""URL schemes of ``remote.url``: plain or TLS (the ``s``), one server or a Redis Cluster."""


class RemoteConfig(Section):
    """The remote tier on Redis 7 / Valkey (used when ``tiers`` names ``remote``).

    Eviction is the server's: give it ``maxmemory`` and ``maxmemory-policy allkeys-lru``; with
    ``notify-keyspace-events Exe`` the tier learns of evictions as they happen, otherwise from
    failed reads.
    """

    url: str = "redis://127.0.0.1:6379/0"
    """``redis://[user:password@]host:port/db`` (one server), ``rediss://...`` (TLS), or
    ``redis-cluster://[user:password@]h1:p1,h2:p2`` (``rediss-cluster://`` with TLS): a Redis Cluster
    reached through any of the listed nodes."""
    username: str | None = None
    """ACL user (overrides one in ``url``); ``null`` uses the URL's or the default user."""
    password: str | None = None
    """Password for AUTH (overrides one in ``url``)."""
    tls_ca_file: str | None = None
    """CA bundle to verify the server with under ``rediss``; ``null`` uses the system's."""
    connect_timeout_s: float = Field(0.5, gt=0, le=60)
    """Longest wait to open a connection."""
    timeout_s: float = Field(1.0, gt=0, le=60)
    """Longest wait for one reply; a slower server counts an error and the access is a miss."""
    probe_timeout_s: float = Field(0.2, gt=0, le=60)
    """Longest a lookup waits for the prefix probe (one pipelined EXISTS, run on the tier's probe thread):
    a later answer makes the remote part of the lookup a miss, counted in ``probe_timeouts`` and
    ``errors``, and the tier backs off as after a failure, so a slow or paused server never stalls the
    engine's thread for longer than this."""
    reconnect_min_s: float = Field(0.05, gt=0, le=60)
    """First back-off after a failure: accesses in that window are misses without a round trip."""
    reconnect_max_s: float = Field(5.0, gt=0, le=600)
    """Longest back-off; each further failure doubles it up to this."""
    group_blocks: int = Field(8, ge=1, le=256)
    """Consecutive full blocks stored as one value, under the chained key of the group's last block.
    Redis evicts values one by one, so a prefix survives eviction far better in groups; only full
    groups go remote."""
    max_inflight_bytes: PositiveSize = "256MiB"  # type: ignore[assignment]
    """Bound on value bytes in flight to or from the server at once; further batches wait. Also bounds
    the ``write_back`` copies waiting to be sent: beyond it a group is shed (counted), never waited for."""
    write: WritePolicy | Literal["read_only"] = "write_through"
    """When a full group goes to the server, as ``policy.write`` for the local tiers: ``write_through``
    once its last block is committed; ``write_through_selective`` once a lookup has matched its last
    block ``selective_hits`` times (SGLang HiCache's semantics: only reused prefixes cross the network);
    ``write_back`` only when one of its blocks is about to leave the last local tier: the GPU or the
    host tier when ``tiers`` names no disk tier, else the LMDB, file or slab tier, whose evictions show their
    victims to the remote writer first (each group once; a group is shed, counted, while
    ``max_inflight_bytes`` of copies wait for a slow server). ``read_only``: this engine only reads
    what others stored."""
    selective_hits: int = Field(SELECTIVE_HITS_DEFAULT, ge=1, le=1_000_000)
    """Lookups that must match a group's last block before it is stored under ``write_through_selective``."""
    ttl_s: float | None = Field(None, gt=0)
    """Expiry of stored values in seconds; ``null`` keeps them until Redis evicts them."""
    key_prefix: str = "kvstore:"
    """Prefix of every Redis key (the rest is the hex block key, which already carries the layout
    fingerprint and the tenant salt)."""
    codec: Literal["none", "zstd", "shuffle_zstd"] = "none"
    """Payload encoding of each block, as for the disk tier."""
    codec_level: int = Field(1, ge=1, le=22)
    """zstd compression level."""
    io_threads: int = Field(2, ge=1, le=64)
    """Threads doing remote I/O so the engine never waits on the network."""
    listen_evictions: bool = True
    """Subscribe to ``__keyevent@*__:evicted`` (needs ``notify-keyspace-events`` with ``E`` and ``e``)."""

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if scheme not in REMOTE_SCHEMES:
            raise ValueError(f"remote.url {url!r}: the scheme must be one of {', '.join(s + '://' for s in REMOTE_SCHEMES)}")
        if not url.split("://", 1)[1].split("@")[-1].split("/")[0]:
            raise ValueError(f"remote.url {url!r} names no host")
        return url
