"""The router's view of the fleet: block key -> {replica: tiers}, built from the replicas' KV events.

One owner per fact: ``_held[replica][key]`` (a bit mask of tiers) is what a
replica said it holds; ``_holders[key]`` (the replicas with any bit for
``key``) is a cache of it for lookups, changed only next to ``_held`` in
:meth:`RouterIndex._set` and :meth:`RouterIndex.clear`, and checked by
:meth:`RouterIndex.check_integrity`.

A block in the shared ``remote`` tier is readable by every replica, so
:meth:`RouterIndex.cached_prefix` counts it for all of them (the policy gives
that tier a lower weight than a replica's own tiers). Who reported it still
matters: a removal applies only to its sender's report.

A *store* (:meth:`RouterIndex.add_store`: a sidecar daemon's feed) is a sender
that is not a replica: what it holds counts, in its own tiers, for the
replicas it serves (the engines sharing that daemon), and it is never a
routing target itself.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.route.kv_events import (
    ROUTE_TIERS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    RouteTier,
    tier_of,
)

BlockHash = Hashable
"""A block's key: kvstore's 32-byte key, or whatever a vLLM replica published (``bytes`` or ``int``)."""

_BIT: dict[str, int] = {t: 1 << i for i, t in enumerate(ROUTE_TIERS)}
_ALL = (1 << len(ROUTE_TIERS)) - 1
_REMOTE = _BIT["remote"]
_LOCAL = _ALL & ~_REMOTE


@dataclass(frozen=True)
class PrefixHit:
    """How much of a prompt one replica can serve from cache."""

    blocks: int
    """Consecutive prompt blocks from the start cached on that replica (its own tiers or the shared remote)."""
    by_tier: dict[str, int] = field(default_factory=dict)
    """Of those, how many in each tier (each block counted once, in its fastest tier: gpu, host, disk, remote)."""


def _fastest(mask: int) -> str:
    """The fastest tier set in ``mask`` (non-zero)."""
    low = mask & -mask
    return ROUTE_TIERS[low.bit_length() - 1]


class RouterIndex:
    """Which replica holds which block in which tier. Not thread-safe: one thread applies and queries
    (the subscriber and the front serialise through their own lock)."""

    def __init__(self) -> None:
        self._held: dict[str, dict[BlockHash, int]] = {}
        self._holders: dict[BlockHash, set[str]] = {}
        self._remote: dict[BlockHash, int] = {}  # key -> how many replicas report it in the remote tier
        self._stores: dict[str, frozenset[str] | None] = {}  # store -> the replicas it serves (None: every one)
        self.events_applied = 0
        """Events applied since creation (all replicas)."""

    # ----------------------------------------------------------- changes
    def add_replica(self, replica: str) -> None:
        """Make ``replica`` known with nothing cached (it then appears in :meth:`cached_prefix`). Idempotent.
        Raises ``ValueError`` if ``replica`` is a store's name."""
        if replica in self._stores:
            raise ValueError(f"{replica!r} is a store; a replica needs a name of its own")
        self._held.setdefault(replica, {})

    def add_store(self, store: str, serves: Iterable[str] | None = None) -> None:
        """Make ``store`` known as a shared store (not a replica) whose blocks count for the replicas in
        ``serves`` (``None``: every replica), with nothing held yet. Its events are applied like a
        replica's (:meth:`apply` with ``store`` as the sender). Raises ``ValueError`` if ``store`` is a
        replica already."""
        if store in self._held and store not in self._stores:
            raise ValueError(f"{store!r} is a replica; a store needs a name of its own")
        self._stores[store] = None if serves is None else frozenset(serves)
        self._held.setdefault(store, {})

    def remove_replica(self, replica: str) -> None:
        """Forget ``replica`` (or store) and everything it reported."""
        self.clear(replica)
        del self._held[replica]
        self._stores.pop(replica, None)

    def apply(self, replica: str, batch: KVEventBatch) -> None:
        """Apply one batch from ``replica``, in order: stored adds tiers; removed takes tiers away from
        ``replica`` only (medium ``None``: every tier); all-cleared empties ``replica``.

        Every medium is checked before anything changes: a batch naming an unknown medium raises
        :class:`~kvstore.route.kv_events.EventFormatError` and changes nothing.
        """
        tiers = [tier_of(ev.medium) if not isinstance(ev, AllBlocksCleared) else None for ev in batch.events]
        held = self._held.setdefault(replica, {})
        for ev, tier in zip(batch.events, tiers):
            if isinstance(ev, BlockStored):
                assert tier is not None
                bit = _BIT[tier]
                for h in ev.block_hashes:
                    self._set(replica, held, h, held.get(h, 0) | bit)
            elif isinstance(ev, BlockRemoved):
                bits = _ALL if ev.medium is None else _BIT[tier]  # type: ignore[index]
                for h in ev.block_hashes:
                    old = held.get(h)
                    if old is not None:
                        self._set(replica, held, h, old & ~bits)
            else:
                self.clear(replica)
            self.events_applied += 1

    def store(self, replica: str, keys: Iterable[BlockHash], tier: RouteTier) -> None:
        """Record that ``replica`` holds ``keys`` in ``tier`` (a full report's entries; no event counted)."""
        held = self._held.setdefault(replica, {})
        bit = _BIT[tier]
        for h in keys:
            self._set(replica, held, h, held.get(h, 0) | bit)

    def clear(self, replica: str) -> None:
        """``replica`` holds nothing (all-cleared, a restart, before a full report). Others are untouched."""
        held = self._held.get(replica)
        if not held:
            return
        for h, mask in held.items():
            holders = self._holders[h]
            holders.discard(replica)
            if not holders:
                del self._holders[h]
            if mask & _REMOTE:
                self._drop_remote(h)
        held.clear()

    def _set(self, replica: str, held: dict[BlockHash, int], h: BlockHash, mask: int) -> None:
        """The one place a replica's mask for ``h`` changes (keeps ``_holders`` and ``_remote`` true)."""
        old = held.get(h, 0)
        if mask == old:
            return
        if (old ^ mask) & _REMOTE:
            if mask & _REMOTE:
                self._remote[h] = self._remote.get(h, 0) + 1
            else:
                self._drop_remote(h)
        if mask:
            held[h] = mask
            if not old:
                self._holders.setdefault(h, set()).add(replica)
        else:
            del held[h]
            holders = self._holders[h]
            holders.discard(replica)
            if not holders:
                del self._holders[h]

    def _drop_remote(self, h: BlockHash) -> None:
        n = self._remote[h] - 1
        if n:
            self._remote[h] = n
        else:
            del self._remote[h]

    # ----------------------------------------------------------- queries
    def replicas(self) -> list[str]:
        """Every known replica, sorted by name (stores are not replicas)."""
        return sorted(r for r in self._held if r not in self._stores)

    def stores(self) -> list[str]:
        """Every known store, sorted by name."""
        return sorted(self._stores)

    def blocks(self, replica: str) -> int:
        """How many blocks ``replica`` holds in any tier (0 for an unknown replica)."""
        return len(self._held.get(replica, ()))

    def tiers(self, replica: str, key: BlockHash) -> set[str]:
        """The tiers ``replica`` reported ``key`` in (empty when none). Changes nothing."""
        mask = self._held.get(replica, {}).get(key, 0)
        return {t for t in ROUTE_TIERS if mask & _BIT[t]}

    def cached_prefix(self, keys: Sequence[BlockHash]) -> dict[str, PrefixHit]:
        """For every known replica, the cached prefix of the prompt whose block keys are ``keys``.

        A block counts for a replica while it is in one of that replica's tiers, in a store serving it,
        or in the shared remote tier; the prefix stops at the first block that does not. Changes nothing.
        """
        if self._stores:
            return self._cached_prefix_with_stores(keys)
        names = self._held
        counts: dict[str, dict[str, int]] = {r: {} for r in names}
        depth = dict.fromkeys(names, 0)
        alive = set(names)
        for h in keys:
            holders = self._holders.get(h)
            in_remote = h in self._remote
            if not in_remote:
                alive = alive & holders if holders else set()
            if not alive:
                break
            for r in alive:
                mask = names[r].get(h, 0) & _LOCAL
                tier = _fastest(mask) if mask else "remote"
                c = counts[r]
                c[tier] = c.get(tier, 0) + 1
                depth[r] += 1
        return {r: PrefixHit(depth[r], counts[r]) for r in names}

    def _cached_prefix_with_stores(self, keys: Sequence[BlockHash]) -> dict[str, PrefixHit]:
        """:meth:`cached_prefix` when stores exist: a store's holding counts for each replica it serves."""
        held, stores = self._held, self._stores
        names = [r for r in held if r not in stores]
        served = {s: (frozenset(names) if serves is None else serves & set(names)) for s, serves in stores.items()}
        via = {r: [s for s, rs in served.items() if r in rs] for r in names}  # replica -> stores serving it
        counts: dict[str, dict[str, int]] = {r: {} for r in names}
        depth = dict.fromkeys(names, 0)
        alive = set(names)
        for h in keys:
            if h not in self._remote:
                holders = self._holders.get(h, ())
                reach = {r for r in holders if r not in stores}
                for s in holders:
                    if s in stores:
                        reach |= served[s]
                alive &= reach
            if not alive:
                break
            for r in alive:
                mask = held[r].get(h, 0)
                for s in via[r]:
                    mask |= held[s].get(h, 0)
                mask &= _LOCAL
                tier = _fastest(mask) if mask else "remote"
                c = counts[r]
                c[tier] = c.get(tier, 0) + 1
                depth[r] += 1
        return {r: PrefixHit(depth[r], counts[r]) for r in names}

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless ``_holders`` and ``_remote`` agree with ``_held``. Changes nothing."""
        holders: dict[BlockHash, set[str]] = {}
        remote: dict[BlockHash, int] = {}
        for r, held in self._held.items():
            for h, mask in held.items():
                assert mask, f"replica {r} keeps an empty mask for {h!r}"
                holders.setdefault(h, set()).add(r)
                if mask & _REMOTE:
                    remote[h] = remote.get(h, 0) + 1
        assert holders == self._holders, "the holders cache differs from the replicas' reports"
        assert remote == self._remote, "the remote counts differ from the replicas' reports"
