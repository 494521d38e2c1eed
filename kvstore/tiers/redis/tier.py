"""The remote tier: groups of blocks in Redis or Valkey (standalone or Redis Cluster), shared by a fleet.

::

    chain  k0 k1 k2 k3 | k4 k5 k6 k7 | k8 k9        (G = 4)
    values [g0 under k3] [g1 under k7]  (k8, k9: a partial group, never stored)

A probe is one pipelined EXISTS per group, cut at the first missing one; a load or a store is one
pipelined GET or ``SET NX`` per group (in a cluster redis-py's pipeline splits the commands by node,
where a plain MGET across slots would fail). Loads and stores run on the calling worker thread (the
store's prefetch and remote-write workers, or :meth:`get_async`/:meth:`put_async`), never holding
the store's lock, and under a bound on value bytes in flight. A lookup's probe runs on the tier's own
probe threads and is waited for at most ``probe_timeout_s``: a slow or paused server makes it a miss
(``probe_timeouts``), never a stalled engine.

Failures never reach the engine: a connection error, a timeout or a cluster that is failing over
makes the access a miss (or an unstored put), counted in ``errors``; the tier then skips the server
for a back-off window (``skipped``) that doubles per failure, and the first success after it counts a
reconnect. Eviction is Redis's (``maxmemory`` + ``allkeys-lru``); the tier learns of it from keyspace
notifications (``evictions_notified``) or, when they are off, from a read that finds no value
(``evictions_inferred``). A value that fails verification is deleted, counted and a miss.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis

from kvstore.util.budget import ByteBudget
from kvstore.tiers.codec import HEADER_SIZE
from kvstore.config.remote import RemoteConfig
from kvstore.errors import CorruptBlock, short_key
from kvstore.layout import KVLayout
from kvstore.tiers.redis.backoff import Backoff
from kvstore.tiers.base import Buffer, TierStats, check_buffers
from kvstore.tiers.chain import ChainTier, groups_of
from kvstore.tiers.redis.group_value import decode_group, encode_group
from kvstore.tiers.redis.client import make_client, node_client, parse_target
from kvstore.tiers.redis.evictions import EvictionListener

log = logging.getLogger("kvstore.tiers.redis.tier")

FAILURES = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)
"""What a round trip may raise that means "the server is unavailable", not a bug."""


@dataclass
class RemoteStats(TierStats):
    """:class:`TierStats` plus what only a remote tier has (``evictions`` = notified + inferred, in blocks).

    ``used_bytes`` and ``capacity_bytes`` are the server's ``used_memory`` and ``maxmemory`` from
    ``INFO memory`` at the time of :meth:`RedisTier.stats` (summed over a cluster's primaries; the
    replicas hold copies), so they count every key of the shared server, not only this engine's;
    ``capacity_bytes`` is 0 when a server has no ``maxmemory``, and both are 0 while the server does not
    answer. ``num_blocks`` stays 0: the server is shared by a fleet and evicts on its own.
    """

    errors: int = 0
    """Round trips (or single commands in one) that failed: connection refused or lost, timeout, cluster down."""
    skipped: int = 0
    """Accesses answered as misses without a round trip because the tier was backing off."""
    reconnects: int = 0
    """Successful round trips that ended a run of failures."""
    evictions_notified: int = 0
    """Blocks whose value Redis reported evicted (keyspace notifications)."""
    evictions_inferred: int = 0
    """Blocks whose value a read found missing (evicted, expired or deleted elsewhere)."""
    probe_timeouts: int = 0
    """Prefix probes not answered within ``probe_timeout_s`` (answered as misses; also in ``errors``)."""
    groups_stored: int = 0
    """Values newly stored (each ``group_blocks`` blocks)."""


class RedisTier(ChainTier):
    """Blocks in groups of ``cfg.group_blocks`` on a Redis server or cluster (see the module docstring).

    As a :class:`Tier`, ``keys`` passed to :meth:`contains_prefix`, :meth:`get` and :meth:`put` are a
    chain from a group boundary: ``keys[0:G]`` is one group, and so on (with ``group_blocks: 1`` any
    keys). :meth:`probe`, :meth:`load` and :meth:`store` take the chain and a position instead.
    """

    name = "remote"
    reports_evictions = False  # shared with other engines: the index never mirrors it, lookups ask it

    def __init__(self, layout: KVLayout, cfg: RemoteConfig) -> None:
        super().__init__(layout)
        self._stats: RemoteStats = RemoteStats()
        self.cfg = cfg
        self.group_blocks = cfg.group_blocks
        self.target = parse_target(cfg.url)[0]
        self._client: Any = None  # made on first use: a cluster client connects when it is built
        self._client_lock = threading.Lock()
        self._prefix = cfg.key_prefix.encode()
        self._fp, self._itemsize = layout.fingerprint, layout.itemsize
        self._value_bytes = cfg.group_blocks * (HEADER_SIZE + layout.bytes_per_block)
        self._budget = ByteBudget(int(cfg.max_inflight_bytes))
        self._backoff = Backoff(cfg.reconnect_min_s, cfg.reconnect_max_s)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=cfg.io_threads, thread_name_prefix="kvstore-remote")
        self._probes = ThreadPoolExecutor(max_workers=cfg.io_threads, thread_name_prefix="kvstore-remote-probe")
        """Its own threads, so a queue of loads or stores never delays a lookup's probe."""
        self._listener: EvictionListener | None = None
        if cfg.listen_evictions:
            self._listener = self._start_listener()

    @classmethod
    def from_config(cls, section: RemoteConfig, layout: KVLayout) -> RedisTier:
        """Build from the ``remote`` config section (connects lazily: a server down at start is a miss, not an error)."""
        return cls(layout, section)

    # ------------------------------------------------------------ keys
    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of the value whose last block is ``key``: ``key_prefix`` + the key in hex."""
        return self._prefix + key.hex().encode()

    def block_key(self, redis_key: bytes) -> bytes | None:
        """Inverse of :meth:`redis_key`; ``None`` for a key this tier did not make."""
        if not redis_key.startswith(self._prefix):
            return None
        try:
            key = bytes.fromhex(redis_key[len(self._prefix):].decode("ascii"))
        except ValueError:
            return None
        return key if len(key) == 32 else None

    # ------------------------------------------------------------ chain API
    def probe(self, chain: Sequence[bytes], start: int = 0) -> int:
        """See :meth:`ChainTier.probe`: one pipelined EXISTS per group from ``start``'s, on the probe
        threads; waits at most ``probe_timeout_s`` (later: the groups are misses, counted). Changes nothing."""
        g = self.group_blocks
        first = start // g
        groups = range(first, len(chain) // g)
        if not groups:
            return first * g
        if not self._backoff.allow():
            self._count(skipped=1)
            return first * g
        fut = self._probes.submit(self._probe_groups, chain, groups)
        try:
            found = fut.result(timeout=self.cfg.probe_timeout_s)
        except TimeoutError:
            delay = self._backoff.failed()
            self._count(errors=1, probe_timeouts=1)
            log.warning("remote tier %s: prefix probe unanswered after %.3fs; a miss, retrying in %.2fs",
                        self.target.describe(), self.cfg.probe_timeout_s, delay)
            return first * g
        return (first + found) * g

    def _probe_groups(self, chain: Sequence[bytes], groups: range) -> int:
        """How many of ``groups`` (consecutive) are stored, up to the first missing one (one round trip)."""
        g = self.group_blocks
        res = self._pipeline(lambda p: [p.exists(self.redis_key(chain[i * g + g - 1])) for i in groups])
        found = 0
        for r in res or []:
            if isinstance(r, BaseException) or not r:
                break
            found += 1
        return found

    def load(self, chain: Sequence[bytes], start: int, dests: Sequence[Buffer]) -> list[bool]:
        """See :meth:`ChainTier.load`: one pipelined GET per group, in batches under the byte bound."""
        g = self.group_blocks
        stop = start + len(dests)
        out = [False] * len(dests)
        groups = [i for i in groups_of(start, stop, g) if i * g + g <= len(chain)]
        for batch in self._batches(groups):
            nbytes = len(batch) * self._value_bytes
            self._budget.acquire(nbytes)
            try:
                values = self._pipeline(lambda p: [p.get(self.redis_key(chain[i * g + g - 1])) for i in batch])
            finally:
                self._budget.release(nbytes)
            if values is None:
                break
            for i, value in zip(batch, values):
                lo, hi = max(start, i * g), min(stop, i * g + g)
                if self._settle_read(chain[i * g: i * g + g], value, {p - i * g: dests[p - start] for p in range(lo, hi)}):
                    for p in range(lo, hi):
                        out[p - start] = True
        misses = out.count(False)
        self._count(hits=len(out) - misses, misses=misses, bytes_read=(len(out) - misses) * self.layout.bytes_per_block)
        return out

    def store(self, chain: Sequence[bytes], start: int, srcs: Sequence[Buffer]) -> int:
        """See :meth:`ChainTier.store`: one pipelined ``SET NX`` per full group. Returns blocks stored now."""
        g = self.group_blocks
        if start % g:
            raise ValueError(f"remote store: start {start} is not a multiple of group_blocks {g}")
        groups = list(range(start // g, (start + len(srcs)) // g))
        groups = [i for i in groups if i * g + g <= len(chain)]
        return sum(self._store_groups(chain, start, srcs, groups)) * g

    def _store_groups(self, chain: Sequence[bytes], start: int, srcs: Sequence[Buffer], groups: list[int]) -> list[bool]:
        g = self.group_blocks
        px = int(self.cfg.ttl_s * 1000) if self.cfg.ttl_s is not None else None
        ok: list[bool] = []
        for batch in self._batches(groups):
            values = [
                encode_group(chain[i * g: i * g + g], srcs[i * g - start: i * g + g - start], self.cfg.codec,
                             self.cfg.codec_level, self._fp, self._itemsize)
                for i in batch
            ]
            nbytes = sum(len(v) for v in values)
            self._budget.acquire(nbytes)
            try:
                res = self._pipeline(lambda p: [p.set(self.redis_key(chain[i * g + g - 1]), v, nx=True, px=px)
                                                for i, v in zip(batch, values)])
            finally:
                self._budget.release(nbytes)
            if res is None:
                ok.extend([False] * (len(groups) - len(ok)))
                break
            new = sum(1 for r in res if r is True)
            ok.extend(not isinstance(r, BaseException) for r in res)
            self._count(groups_stored=new, puts=new * g, bytes_written=new * g * self.layout.bytes_per_block)
        return ok

    # ------------------------------------------------------------ Tier API
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Blocks of the chain ``keys`` (from a group boundary) stored, in whole groups. Changes nothing."""
        return self.probe(keys, 0)

    def contains(self, key: bytes) -> bool:
        """Whether a value is stored under ``key`` (the last key of a group). Changes nothing."""
        res = self._pipeline(lambda p: [p.exists(self.redis_key(key))])
        return bool(res and not isinstance(res[0], BaseException) and res[0])

    def get(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        """:meth:`load` of the chain ``keys`` from position 0."""
        check_buffers(keys, dests, self.layout.bytes_per_block, self.name)
        return self.load(keys, 0, dests)

    def put(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        """Store the chain ``keys`` in full groups; ``result[i]`` is whether block ``i``'s group is stored
        (already stored counts); the blocks of a trailing partial group are ``False``."""
        check_buffers(keys, srcs, self.layout.bytes_per_block, self.name)
        g = self.group_blocks
        ok = self._store_groups(keys, 0, srcs, list(range(len(keys) // g)))
        out = [False] * len(keys)
        for i, stored in enumerate(ok):
            out[i * g: i * g + g] = [stored] * g
        return out

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete the values stored under these keys; returns how many existed."""
        res = self._pipeline(lambda p: [p.delete(self.redis_key(k)) for k in keys])
        return sum(int(r) for r in res or [] if not isinstance(r, BaseException))

    def get_async(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> Future[list[bool]]:
        """:meth:`get` on the tier's I/O threads."""
        return self._pool.submit(self.get, keys, dests)

    def put_async(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> Future[list[bool]]:
        """:meth:`put` on the tier's I/O threads."""
        return self._pool.submit(self.put, keys, srcs)

    def stats(self) -> RemoteStats:
        """A snapshot copy of the counters, with the server's memory use and limit (:meth:`server_memory`)."""
        used, capacity = self.server_memory()
        with self._lock:
            out = RemoteStats(**self._stats.as_dict())
        out.used_bytes, out.capacity_bytes = used, capacity
        return out

    def server_memory(self) -> tuple[int, int]:
        """``(used_memory, maxmemory)`` of the server, summed over a cluster's primaries; ``maxmemory`` is 0
        when any of them has none (unbounded). ``(0, 0)`` when the server does not answer within
        ``probe_timeout_s`` (asked on the probe threads, so a stats call never waits longer), or while
        the tier backs off. Changes nothing."""
        if not self._backoff.allow():
            return 0, 0
        try:
            return self._probes.submit(self._info_memory).result(timeout=self.cfg.probe_timeout_s)
        except TimeoutError:
            return 0, 0

    def _info_memory(self) -> tuple[int, int]:
        try:
            client = self._connected()
            if self.target.cluster:
                infos = list(client.info("memory", target_nodes=client.PRIMARIES).values())
            else:
                infos = [client.info("memory")]
        except FAILURES:
            return 0, 0
        used = sum(int(i.get("used_memory", 0)) for i in infos)
        limits = [int(i.get("maxmemory", 0)) for i in infos]
        return used, 0 if not limits or 0 in limits else sum(limits)

    def close(self) -> None:
        """Stop the eviction listeners and the I/O threads, close the connections."""
        if self._listener is not None:
            self._listener.close()
        self._pool.shutdown(wait=True)
        self._probes.shutdown(wait=True)
        if self._client is not None:
            self._client.close()

    # ------------------------------------------------------------ internals
    def _settle_read(self, keys: Sequence[bytes], value: Any, dests: dict[int, Buffer]) -> bool:
        """Decode one group's value into ``dests``, or count why not; returns whether ``dests`` are filled."""
        if isinstance(value, BaseException):
            return False  # counted in errors by _pipeline
        if value is None:
            self._count(evictions=len(keys), evictions_inferred=len(keys))
            self._emit("evicted", keys[-1])
            return False
        try:
            decode_group(value, keys, dests, self._fp)
        except CorruptBlock as exc:
            log.warning("remote value %s is corrupt (%s); deleted, treated as a miss", short_key(keys[-1]), exc)
            self._pipeline(lambda p: [p.delete(self.redis_key(keys[-1]))])
            self._count(corrupt_dropped=len(keys))
            self._emit("corrupt", keys[-1])
            return False
        return True

    def _batches(self, groups: list[int]) -> list[list[int]]:
        """Split groups so one batch's values fit in the byte bound (at least one group per batch)."""
        per = max(1, self._budget.limit // self._value_bytes)
        return [groups[i: i + per] for i in range(0, len(groups), per)]

    def _pipeline(self, build: Callable[[Any], list[Any]]) -> list[Any] | None:
        """Run the commands ``build`` queues on a pipeline in one round trip; ``None`` if the server is
        unavailable (counted). A failed command comes back as its exception (and is counted)."""
        if not self._backoff.allow():
            self._count(skipped=1)
            return None
        try:
            pipe = self._connected().pipeline(transaction=False)
            build(pipe)
            res: list[Any] = pipe.execute(raise_on_error=False)
        except FAILURES as exc:
            delay = self._backoff.failed()
            self._count(errors=1)
            if self._backoff.failures == 1:
                log.warning("remote tier %s unavailable (%s: %s); misses until it answers, retrying in %.2fs",
                            self.target.describe(), type(exc).__name__, exc, delay)
            return None
        failed = sum(1 for r in res if isinstance(r, BaseException))
        if failed and failed == len(res):
            self._backoff.failed()
        elif self._backoff.succeeded():
            self._count(reconnects=1)
            log.info("remote tier %s answers again", self.target.describe())
        if failed:
            self._count(errors=failed)
        return res

    def _connected(self) -> Any:
        """The client, made on first use (may raise a connection error, which the caller counts)."""
        with self._client_lock:
            if self._client is None:
                self._client = make_client(self.cfg)[0]
            return self._client

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)

    def _on_evicted(self, redis_key: bytes) -> None:
        key = self.block_key(redis_key)
        if key is None:
            return  # another application's key on a shared server
        self._count(evictions=self.group_blocks, evictions_notified=self.group_blocks)
        self._emit("evicted", key)

    def _start_listener(self) -> EvictionListener:
        nodes = self._nodes()
        return EvictionListener(nodes, lambda h, p: node_client(self.cfg, h, p), self._on_evicted, self.cfg.reconnect_max_s)

    def _nodes(self) -> list[tuple[str, int]]:
        """The seed nodes and every node the cluster reports (primaries and replicas), or the one server."""
        nodes = list(self.target.nodes)
        if self.target.cluster:
            try:
                nodes += [(n.host, n.port) for n in self._connected().get_nodes()]
            except FAILURES:
                pass  # the seeds only; a node added later is not listened to (reads still find evictions)
        return list(dict.fromkeys(nodes))

