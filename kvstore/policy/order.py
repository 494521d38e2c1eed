"""Eviction orders by name: the small interface the host and disk tiers evict through.

An eviction order tracks which keys a tier holds, the bytes each is
accounted for, and which keys to give up when a write needs room. The tier
owns the data and the lock; the order only decides. Three exist:

- ``lru`` (:class:`~kvstore.policy.lru.LRUIndex`): least recently used first.
- ``s3fifo`` (:class:`~kvstore.policy.s3fifo.S3FIFOIndex`): small / main /
  ghost FIFO queues; resists scans and reuse distances longer than the cache,
  which defeat LRU.
- ``gdsf`` (:class:`~kvstore.policy.gdsf.GDSFIndex`): lowest ``L + use
  count`` first, ``L`` the last victim's priority (frequency with aging);
  ``make_order(name, weight)`` weighs the count otherwise
  (:data:`~kvstore.policy.gdsf.DAMPED`, a placement policy's ``weight``), for
  ``gdsf`` and the GDSF contender of ``duel``.
- ``duel`` (:class:`~kvstore.policy.duel.DuelIndex`): GDSF or S3-FIFO (with
  or without carried counts), chosen online by which one's miniature, on a
  hash sample of the keys, hits more.

Chosen for the host and disk tiers together by the placement policy (``policy.placement``,
:mod:`kvstore.policy.named`), which builds them and hands each tier its own::

    orders = config.policy.placement_policy().orders()

Protocol of every order. Who changes what:

- ``add`` / ``add_oldest`` / ``remove`` change membership and ``used``;
- ``touch`` records a use (LRU: moves the key; S3-FIFO: raises its frequency; GDSF: raises its count);
- ``seed`` replaces a key's use count by one kept outside the tier (GDSF; S3-FIFO with ``seed_to_main``
  moves a key seeded with 2+ uses to main; LRU ignores it);
- ``victims`` never changes membership, sizes or ``used``; the caller removes
  the keys it returns once they are really gone. LRU's ``victims`` changes
  nothing at all; S3-FIFO's reorders its queues and records ghosts (see
  :meth:`S3FIFOIndex.victims`) and GDSF's raises its inflation ``L``, so
  call it only when about to evict;
- ``oldest``, ``size_of``, ``in``, ``len`` and iteration change nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from kvstore.policy.duel import DuelIndex
from kvstore.policy.exclude import Exclude
from kvstore.policy.gdsf import LINEAR, CountWeight, GDSFIndex
from kvstore.policy.lru import LRUIndex
from kvstore.policy.s3fifo import S3FIFOIndex


class EvictionOrder(Protocol):
    """What a tier needs from an eviction order (see the module docstring for what each call changes)."""

    used: int
    """Sum of the accounted sizes of the keys held."""

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[bytes]:
        """Keys, those evicted first (ignoring frequencies) first."""
        ...

    def add(self, key: bytes, size: int) -> None:
        """Insert a new ``key`` accounted at ``size`` bytes (replacing the size if present)."""
        ...

    def add_oldest(self, key: bytes, size: int) -> None:
        """Insert ``key`` as the next to evict among blocks with a history (for restoring after a restart)."""
        ...

    def touch(self, key: bytes) -> bool:
        """Record a use of ``key``; ``False`` if absent."""
        ...

    def seed(self, key: bytes, uses: int) -> bool:
        """Record that ``key`` was used ``uses`` times before it entered this tier (GDSF: count := uses;
        LRU, S3-FIFO: ignored); ``False`` if absent."""
        ...

    def remove(self, key: bytes) -> int | None:
        """Forget ``key``; its size, or ``None`` if absent."""
        ...

    def size_of(self, key: bytes) -> int | None:
        """Accounted size of ``key``, or ``None``."""
        ...

    def victims(self, need: int, budget: int, exclude: Exclude = ()) -> list[bytes]:
        """Keys whose removal makes ``used + need <= budget`` (fewer if impossible); membership unchanged."""
        ...

    def oldest(self, n: int, exclude: Exclude = ()) -> list[bytes]:
        """Up to ``n`` keys in iteration order, skipping ``exclude``. Changes nothing."""
        ...


ORDERS: dict[str, Callable[[CountWeight], EvictionOrder]] = {
    "lru": lambda weight: LRUIndex(), "s3fifo": lambda weight: S3FIFOIndex(), "gdsf": GDSFIndex,
    "duel": lambda weight: DuelIndex(weight=weight),
}
"""Eviction orders by the name used in YAML, each built from GDSF's count weight (unused by LRU and S3-FIFO)."""


def order_for(given: EvictionOrder | None) -> EvictionOrder:
    """A tier's order: ``given``, the placement policy's order for it (:meth:`~kvstore.policy.named.PlacementPolicy.orders`;
    ``ValueError`` unless empty), or LRU for a tier built on its own."""
    if given is None:
        return LRUIndex()
    if len(given):
        raise ValueError(f"the order given already holds {len(given)} keys")
    return given


def make_order(name: str, weight: CountWeight = LINEAR) -> EvictionOrder:
    """A new, empty eviction order ``name`` (``lru``, ``s3fifo``, ``gdsf`` or ``duel``); ``ValueError`` for another name.
    ``weight``: GDSF's count weight, for ``gdsf`` and ``duel``'s GDSF contender (a placement policy's ``weight``)."""
    try:
        factory = ORDERS[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(ORDERS))}") from None
    return factory(weight)
