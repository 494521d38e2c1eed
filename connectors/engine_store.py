"""The kvstore tiers an engine adapter stores engine chunks in: embedded, or a ``kvstore serve`` daemon.

An adapter for another engine (vLLM's secondary tier, SGLang's HiCache
storage backend) keeps its own GPU and host caches and needs from kvstore
only a key-addressed block store below them. :class:`EngineBlockStore` is
that store for one :func:`~connectors.engine_keys.engine_layout`, built from
a kvstore config: ``connector: embedded`` opens the tiers the config names
in this process (:class:`~kvstore.lower.local.LocalTier`: the host tier in
front of the disk tier, written behind to it, run by the daemon's own code;
a lone disk tier when ``tiers`` names no host), ``connector: sidecar`` talks
to the daemon at ``daemon.socket_path`` (whose own host and disk tiers do the
same). Either way the tiers are built by
:func:`kvstore.lower.build.build_lower_tiers` with the placement policy's
orders. Disk blocks are checksummed: a corrupt block is deleted, counted and
reported as missing, never served.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import yaml

from kvstore.config.deadlines import DeadlinesConfig
from kvstore.config.schema import KVStoreConfig
from kvstore.daemon.wire.frames import DaemonError
from kvstore.util.breaker import MissReason
from kvstore.daemon.client.tier import DaemonTier, PutOutcome
from kvstore.hashing import Salt
from kvstore.layout import KVLayout
from kvstore.lower.build import HostPlan, build_lower_tiers
from kvstore.lower.local import LocalTier
from kvstore.tiers.base import Buffer, Tier

log = logging.getLogger(__name__)

CONNECT_WAIT_S = 10.0
"""How long opening a sidecar store waits for the daemon to answer."""


class EngineBlockStore:
    """kvstore's tiers for one engine layout: lookups, reads and writes of whole blocks. Thread-safe as its tiers are."""

    def __init__(self, layout: KVLayout, tiers: Sequence[Tier], forced_salt: bytes | None = None,
                 deadlines: DeadlinesConfig | None = None) -> None:
        self.layout = layout
        self.tiers = list(tiers)
        """Fastest first: every ``put`` goes to all of them, a ``get`` reads the fastest that has the block."""
        self._forced_salt = forced_salt
        self.deadlines = deadlines or DeadlinesConfig()
        """How long a call into the store may take (a daemon tier's lookups, loads and saves keep to it)."""

    def load_deadline_s(self, nbytes: int) -> float:
        """Seconds a load of ``nbytes`` may take before the engine recomputes those blocks instead: the slowest
        daemon tier's (:meth:`~kvstore.daemon.client.tier.DaemonTier.load_deadline_s`); the floor for tiers in this
        process (their reads do not stall)."""
        daemons = [t.load_deadline_s(nbytes) for t in self.tiers if isinstance(t, DaemonTier)]
        return max(daemons, default=self.deadlines.load_floor_ms / 1000)

    @classmethod
    def open(cls, cfg: KVStoreConfig, layout: KVLayout, client_name: str = "") -> EngineBlockStore:
        """The store ``cfg`` describes, for ``layout`` (the engine's; ``cfg.model`` is not used).

        ``cfg.connector == "sidecar"``: connect to the daemon (raises
        :class:`~kvstore.daemon.client.connection.DaemonUnavailable` if none answers within
        :data:`CONNECT_WAIT_S`; a daemon started for another layout refuses
        with a :class:`~kvstore.daemon.wire.frames.DaemonError` whose message
        includes the ``model:`` section its config needs). Otherwise build
        ``cfg.tiers`` here: with ``host``, one :class:`~kvstore.lower.local.LocalTier` (host, disk and
        remote composed as in the daemon); without, the disk tier alone.
        """
        if cfg.connector == "sidecar":
            try:
                tier = DaemonTier.from_config(cfg, client_name, CONNECT_WAIT_S, layout)
            except DaemonError as exc:
                raise DaemonError(exc.code, f"{exc.message}; a daemon for this engine needs this model section in its "
                                            f"config:\n{daemon_model_section(layout)}") from None
            assert tier.client.hello is not None  # connected
            return cls(layout, [tier], forced_salt=tier.client.hello.salt, deadlines=cfg.deadlines)
        if "host" in cfg.tiers:
            return cls(layout, [LocalTier.from_config(cfg, layout)], deadlines=cfg.deadlines)
        if "remote" in cfg.tiers:
            raise ValueError(f"tiers {cfg.tiers}: the remote tier is fed through the host tier in this process; "
                             "add host to tiers, or run a daemon (connector: sidecar)")
        tiers = build_lower_tiers(cfg, layout, HostPlan(auto_evict=True))
        return cls(layout, [t for t in (tiers.disk,) if t is not None], deadlines=cfg.deadlines)

    def salt(self, requested: Salt) -> Salt:
        """The salt keys are made with: the daemon's tenant salt when it assigned one (the trusted side decides), else ``requested``."""
        return self._forced_salt if self._forced_salt is not None else requested

    def contains(self, key: bytes) -> bool:
        """Whether any tier holds ``key``. Changes nothing."""
        return any(t.contains(key) for t in self.tiers)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, consecutively from the first, some tier holds. Changes nothing.

        The run may alternate between tiers (a block evicted from the host tier is still on disk), so
        each tier extends it from where the others stopped until none can.
        """
        n, grew = 0, True
        while grew and n < len(keys):
            grew = False
            for t in self.tiers:
                more = t.contains_prefix(keys[n:])
                if more:
                    n, grew = n + more, True
        return n

    def probe(self, chain: Sequence[bytes], start: int = 0) -> int:
        """How many blocks of ``chain`` (the prompt's keys from position 0), from position 0, some tier holds,
        given the engine holds the first ``start``: :meth:`contains_prefix` past ``start``, except that a tier
        placing blocks by chain position (a daemon with a remote tier) is asked with the whole chain. Changes
        nothing here; such a daemon starts loading what it counts from its remote tier."""
        n, done = start, set[int]()  # tiers asked with nothing found since (asking again costs a round trip)
        while n < len(chain) and len(done) < len(self.tiers):
            for i, t in enumerate(self.tiers):
                if i in done:
                    continue
                more = t.probe(chain, n) - n if t.probes_by_chain else t.contains_prefix(chain[n:])
                if more > 0:
                    n, done = n + more, {i}  # it said all it holds from there; the others may go on
                else:
                    done.add(i)
        return n

    def announce(self, chain: Sequence[bytes]) -> None:
        """Tell the tiers that place blocks by chain position (a daemon with a remote tier) that the next puts
        belong to ``chain`` (keys from position 0), without a lookup: an engine that saves but never loads
        (vLLM's ``kv_producer``) probes nothing, and a daemon sends to its remote tier only the groups of
        chains it was shown. One round trip, no remote I/O (a probe that starts past the chain's end)."""
        for t in self.tiers:
            if t.probes_by_chain:
                t.probe(chain, len(chain))

    def get(self, keys: Sequence[bytes], dests: Sequence[Buffer], deadline_s: float | None = None) -> list[bool]:
        """Copy each block into its destination from the fastest tier holding it; ``result[i]``: ``dests[i]`` filled.

        A block found only in a slower tier is copied into the faster ones too.
        A corrupt copy counts as not found (that tier deleted it). ``deadline_s``: a daemon tier gives up after
        this if sooner than its own load deadline.
        """
        found = [False] * len(keys)
        for i, tier in enumerate(self.tiers):
            todo = [j for j, ok in enumerate(found) if not ok]
            if not todo:
                break
            got = (tier.get([keys[j] for j in todo], [dests[j] for j in todo], deadline_s) if isinstance(tier, DaemonTier)
                   else tier.get([keys[j] for j in todo], [dests[j] for j in todo]))
            hits = [j for j, ok in zip(todo, got) if ok]
            for j in hits:
                found[j] = True
            for faster in self.tiers[:i]:
                faster.put([keys[j] for j in hits], [dests[j] for j in hits])
        return found

    def put(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        """Store blocks in every tier; ``result[i]``: some tier holds ``keys[i]`` afterwards. Stored blocks never change."""
        return self.put_outcome(keys, srcs).stored

    def put_outcome(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> PutOutcome:
        """:meth:`put`, and why some blocks are stored nowhere (the slowest tier's reason: a daemon past its
        deadline, behind an open breaker or gone, or ``no_room``)."""
        stored = [False] * len(keys)
        reason: MissReason | None = None
        for tier in self.tiers:
            if isinstance(tier, DaemonTier):
                outcome = tier.put_outcome(keys, srcs)
            else:
                flags = tier.put(keys, srcs)
                outcome = PutOutcome(flags, None if all(flags) else MissReason.NO_ROOM)
            for j, ok in enumerate(outcome.stored):
                stored[j] = stored[j] or ok
            reason = outcome.reason or reason
        return PutOutcome(stored, None if all(stored) else reason or MissReason.NO_ROOM)

    def health(self) -> list[dict[str, object]]:
        """Each daemon tier's :meth:`~kvstore.daemon.client.tier.DaemonTier.health` (its breaker, misses, bandwidth)."""
        return [t.health() for t in self.tiers if isinstance(t, DaemonTier)]

    def flush(self) -> None:
        """Make every acknowledged put durable in the durable tiers."""
        for t in self.tiers:
            t.flush()

    def close(self) -> None:
        """Flush and release every tier."""
        for t in self.tiers:
            t.close()


def load_store_config(path: str | None) -> KVStoreConfig:
    """The kvstore config at ``path`` (kvstore's own loader and validation), or the defaults for ``None``."""
    from kvstore.config import load_config

    return load_config(path)


def daemon_model_section(layout: KVLayout) -> str:
    """The ``model:`` YAML section a daemon's config needs to accept clients of ``layout``."""
    return yaml.safe_dump({"model": {
        "model_id": layout.model_id, "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim, "block_size": layout.block_size, "dtype": layout.dtype}}, sort_keys=False)
