"""The connector API: the boundary between an inference engine and a KV cache store.

An engine registers its GPU block pool once, then per request::

    match = connector.lookup(tokens, salt)      # how much is cached, by tier
    lease = connector.acquire(match)            # GPU blocks for it, loading
    cached = lease.resolve()                    # stop policy applied
    ... compute tokens[cached:], calling lease.wait_layer(i) before layer i ...
    connector.commit(tokens, block_ids, salt)   # full blocks as they fill
    connector.release(lease); connector.free(own_blocks)

This module owns every type that crosses the boundary (:class:`PrefixMatch`,
:class:`Lease`, :class:`KVConnector`) and imports no store internals, so
another store can implement :class:`KVConnector` with only this module, the
KV layout, the block-key hashing and the GPU block pool. kvstore's own
implementations are :class:`~connectors.embedded.EmbeddedConnector` (the
store lives in the engine's process) and
:class:`~connectors.sidecar.SidecarConnector` (host and disk tiers live in a
``kvstore serve`` daemon; a hit there is named by the daemon's tier that held it, ``daemon:host`` or
``daemon:disk``). Which one is a config setting (``connector:``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.hashing import Salt
from kvstore.layout import KVLayout

__all__ = ["DAEMON_REMOTE_TIER", "DAEMON_TIERS", "LOCAL_TIERS", "REMOTE_TIER", "THROUGH_DAEMON", "TIER_NAMES",
           "KVConnector", "Lease", "PrefixMatch"]

THROUGH_DAEMON = "daemon:"
"""Prefix of a tier reached through a ``kvstore serve`` daemon: ``daemon:host`` is the daemon's host tier."""

TIER_NAMES: tuple[str, ...] = ("gpu", "host", "disk", "daemon:host", "daemon:disk")
"""Where a cached block's fastest copy can be, fastest first: the engine's GPU, the store's host and disk tiers in
the engine's process, or through a daemon its host tier (shared memory) and its disk tier. A config's ``tiers:``
names the disk tier by its kind (``lmdb``, ``file``, ``slab``); here it is ``disk``."""

LOCAL_TIERS: tuple[str, ...] = ("gpu", "host", "disk")
"""The tiers of a connector whose store lives in the engine's process (the default of
:attr:`PrefixMatch.tier_names`)."""

DAEMON_TIERS: tuple[str, ...] = ("gpu", "host", "daemon:host", "daemon:disk")
"""The tiers of a connector whose lower tiers are a daemon's (``connector: sidecar``)."""

REMOTE_TIER = "remote"
"""The shared tier below disk (Redis): a match or a per-tier count names it only when a block came from it."""

DAEMON_REMOTE_TIER = THROUGH_DAEMON + REMOTE_TIER
"""The daemon's remote tier, named like :data:`REMOTE_TIER`: only when a block came from it."""


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a prompt, as :meth:`KVConnector.lookup` found it.

    What the engine reads: the matched blocks' keys (to continue the chain
    when committing), where each block's fastest copy is, and the sizes.
    ``handle`` is the connector's own: whatever its :meth:`KVConnector.acquire`
    needs to find the blocks again; engines pass it back untouched.
    """

    keys: tuple[bytes, ...]
    """Keys of the matched full blocks, in prompt order."""
    tiers: tuple[str, ...]
    """Per matched block, the tier of its fastest copy (one of :attr:`tier_names`, or :attr:`remote_tier`)."""
    block_size: int
    """Tokens per block."""
    prompt_tokens: int
    """Tokens of the prompt that was looked up (matched or not)."""
    handle: Any = field(default=None, compare=False, repr=False)
    """Opaque to the engine: the implementation's own record of the match."""
    tier_names: tuple[str, ...] = LOCAL_TIERS
    """The tiers of the connector that made the match (some of :data:`TIER_NAMES`, fastest first): the keys
    of :meth:`tokens_by_tier`. A sidecar connector's are :data:`DAEMON_TIERS`."""

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tiers):
            raise ValueError(f"PrefixMatch: {len(self.keys)} keys but {len(self.tiers)} tiers")
        unknown = sorted(set(self.tier_names) - set(TIER_NAMES))
        if unknown:
            raise ValueError(f"PrefixMatch: unknown tier name(s) {unknown}; expected some of {TIER_NAMES}")
        bad = sorted(set(self.tiers) - {*self.tier_names, self.remote_tier})
        if bad:
            raise ValueError(f"PrefixMatch: unknown tier(s) {bad}; expected one of "
                             f"{(*self.tier_names, self.remote_tier)}")
        if self.block_size <= 0:
            raise ValueError(f"PrefixMatch: block_size must be positive, got {self.block_size}")

    @property
    def remote_tier(self) -> str:
        """The shared tier below the others, named only when a block came from it: :data:`DAEMON_REMOTE_TIER`
        when :attr:`tier_names` are a daemon's, else :data:`REMOTE_TIER`."""
        through = any(t.startswith(THROUGH_DAEMON) for t in self.tier_names)
        return DAEMON_REMOTE_TIER if through else REMOTE_TIER

    @property
    def num_blocks(self) -> int:
        """Matched full blocks."""
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        """Matched tokens (``num_blocks * block_size``)."""
        return len(self.keys) * self.block_size

    def tokens_in(self, tier: str) -> int:
        """Matched tokens whose fastest copy is in ``tier``."""
        return self.tiers.count(tier) * self.block_size

    def tokens_by_tier(self) -> dict[str, int]:
        """Matched tokens per tier, every tier of :attr:`tier_names` present (:attr:`remote_tier` when matched)."""
        out = {t: self.tokens_in(t) for t in self.tier_names}
        remote = self.remote_tier
        if remote in self.tiers:
            out[remote] = self.tokens_in(remote)
        return out


class Lease(ABC):
    """A request's hold on a cached prefix: GPU blocks holding (or still receiving) its KV.

    Returned by :meth:`KVConnector.acquire`; the engine calls :meth:`resolve`
    once, reads :attr:`block_ids`, calls :meth:`wait_layer` before each layer
    reads them, and ends the lease with :meth:`KVConnector.release`. The
    connector owns the blocks' references: the engine never frees lease
    blocks itself.
    """

    @property
    @abstractmethod
    def block_ids(self) -> list[int]:
        """GPU block ids of the prefix, in order. Changes nothing.

        Before :meth:`resolve`: every block planned at acquire; after it: only
        the usable ones (a prefix of the planned list), final.
        """

    @property
    @abstractmethod
    def shortfall(self) -> str | None:
        """Why the lease holds fewer blocks than were matched (``None`` when it holds them all). Changes nothing."""

    @property
    @abstractmethod
    def load_wait_s(self) -> float:
        """Seconds callers have spent blocked in :meth:`resolve`, :meth:`wait_layer` and :meth:`wait` so far."""

    @abstractmethod
    def resolve(self) -> int:
        """Decide how much of the prefix is usable; returns its cached tokens. Idempotent.

        Changes: applies the store's stop policy (it may wait for loads up to
        that policy's limit), gives back the blocks that will not be used
        (:attr:`block_ids` shrinks to its final value) and starts copying the
        usable ones to the GPU.
        """

    @abstractmethod
    def wait_layer(self, layer: int) -> None:
        """Block until layer ``layer`` of every usable block is on the GPU (resolving first if needed)."""

    @abstractmethod
    def wait(self) -> None:
        """Block until every layer of every usable block is on the GPU (resolving first if needed)."""

    @abstractmethod
    def tokens_by_tier(self) -> dict[str, int]:
        """Tokens of :attr:`block_ids` by the tier each block came from (every tier of the match's
        :attr:`PrefixMatch.tier_names`; its :attr:`PrefixMatch.remote_tier` too when a block came from there)."""

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV the lease provides (planned until resolved). Changes nothing."""
        return sum(self.tokens_by_tier().values())


class KVConnector(ABC):
    """What an engine needs from a KV cache store. Each method says what it changes."""

    @abstractmethod
    def register(self, pool: GPUBlockPool) -> None:
        """Attach the engine's GPU block pool (and so its KV layout). Call once, before anything else."""

    @property
    @abstractmethod
    def layout(self) -> KVLayout:
        """The registered layout."""

    @abstractmethod
    def keys(self, tokens: Sequence[int], salt: Salt = None, parent: bytes | None = None) -> list[bytes]:
        """Block keys of the full blocks of ``tokens`` (continuing ``parent``'s chain if given). Pure.

        The connector decides which salt keys are made with (a daemon may
        assign the tenant); with ``parent`` the chain already carries it.
        """

    @abstractmethod
    def lookup(self, tokens: Sequence[int], salt: Salt = None) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` in any tier. Changes access order and hit counters only."""

    @abstractmethod
    def acquire(self, match: PrefixMatch, window: int = 0) -> Lease:
        """Hold ``match``'s blocks on the GPU for one request.

        Changes: takes a GPU reference on every GPU hit, allocates GPU blocks
        for the lower-tier hits (evicting unused cached blocks if needed) and
        starts loading them. Never blocks on I/O. The lease may cover fewer
        blocks than matched (:attr:`Lease.shortfall` says why). Raises
        ``TypeError``/``ValueError`` for a match another connector made.

        ``window``: when every layer of the engine attends through a sliding window of this many tokens (keys
        ``q - window < k <= q``), blocks wholly before the first uncached query's window may be left unloaded:
        their lease blocks hold the position only, and the engine's kernels never read them. 0 (full
        attention in some layer): every block is loaded. Committing such a lease block records no copy.
        """

    @abstractmethod
    def release(self, lease: Lease) -> None:
        """End a lease: cancel unfinished loads, drop its GPU references, let its blocks be evicted again.

        Idempotent. Raises ``TypeError``/``ValueError`` for a lease another connector made.
        """

    @abstractmethod
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` GPU blocks (one reference each, the caller's) for new tokens, evicting unused cached blocks if needed.

        Raises :class:`kvstore.errors.OutOfBlocks` and takes nothing when it cannot.
        """

    @abstractmethod
    def free(self, block_ids: Sequence[int]) -> None:
        """Drop the caller's reference on each block; committed blocks stay cached."""

    @abstractmethod
    def commit_keys(self, keys: Sequence[bytes], block_ids: Sequence[int], tokens: Sequence[int] | None = None,
                    salt: Salt = None) -> int:
        """Cache full blocks: ``keys[i]`` (a chain from :meth:`keys`) is held in GPU block ``block_ids[i]``.

        Changes: the cache takes its own reference on each new block (the
        caller keeps its own) and applies its write policy (possibly copying
        them down). Keys already cached keep their copy. ``tokens`` (the
        blocks' tokens, ``salt`` the one the keys were made with) let later
        token lookups find the blocks. Returns how many blocks were new.
        """

    def commit(self, tokens: Sequence[int], block_ids: Sequence[int], salt: Salt = None) -> int:
        """:meth:`commit_keys` for the full blocks of ``tokens`` (held in ``block_ids`` from the first block).

        Hashes every block; an engine that commits as blocks fill keeps the
        chain and calls :meth:`commit_keys` with the new keys instead.
        """
        keys = self.keys(tokens, salt)
        n = len(keys)
        if len(block_ids) < n:
            raise ValueError(f"commit: {n} full blocks of tokens but only {len(block_ids)} block ids")
        return self.commit_keys(keys, list(block_ids)[:n], list(tokens)[: n * self.layout.block_size], salt)

    @abstractmethod
    def save(self, keys: Sequence[bytes]) -> int:
        """Copy these cached blocks down to the host tier now and wait (preemption by swap).

        Returns how many are in the host tier afterwards. Blocks stay on the GPU too.
        """

    @abstractmethod
    def offload(self, tier: str) -> int:
        """Move every cached block nobody holds out of ``tier`` into the tier below; returns how many moved.

        ``"gpu"``: cached GPU blocks with no holder other than the cache
        leave the pool (copied down first where the write policy has not
        already; dropped from the cache when there is no lower tier).
        ``"host"``: host-tier blocks are written to the disk tier (if any)
        and leave host memory. Blocks a lease or a sequence holds stay. A
        tier this connector does not manage moves nothing (returns 0); a name
        outside ``{"gpu", "host"}`` raises ``ValueError``. For draining
        before a shutdown, and for placing a prefix in a given tier.
        """

    @abstractmethod
    def flush(self) -> None:
        """Wait for scheduled write-downs and make durable tiers durable.

        After it returns, blocks the write policy sent to the disk tier (or a
        daemon's tiers) before the call survive this process dying. Moves no block.
        """

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Per-tier counters and occupancy. Changes nothing."""

    @abstractmethod
    def close(self) -> None:
        """Flush durable tiers and release every resource."""
