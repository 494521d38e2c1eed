"""Build the lower tiers a config names in ``tiers``."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config.schema import KVStoreConfig
from kvstore.layout import KVLayout
from kvstore.tiers.base import Tier
from kvstore.tiers.chain import ChainTier
from kvstore.tiers.duel import shared_duel
from kvstore.tiers.eviction import EvictionOrder, make_order
from kvstore.tiers.gdsf import LINEAR, WEIGHTS
from kvstore.tiers.host import HostTier


@dataclass(frozen=True)
class LowerTiers:
    """The lower tiers of one store, each ``None`` when ``tiers`` does not name it."""

    host: HostTier | None = None
    disk: Tier | None = None
    remote: ChainTier | None = None


@dataclass(frozen=True)
class BelowGPUOrders:
    """Eviction orders built for the host and the disk tier by the config (``None``: the tier builds its own)."""

    host: EvictionOrder | None = None
    disk: EvictionOrder | None = None


def below_gpu_orders(cfg: KVStoreConfig) -> BelowGPUOrders:
    """The host and the disk tier's eviction orders where the policy section shapes them: under
    ``policy.duel_scope: below_gpu`` the two :class:`~kvstore.tiers.duel.DuelIndex` of one shared referee
    (host level 0, disk level 1); under a ``policy.gdsf_weight`` other than ``linear`` each tier's order
    built with that weight (:func:`~kvstore.tiers.eviction.make_order`); otherwise none. The store and the
    daemon pass them to the tiers they build."""
    weight = WEIGHTS[cfg.policy.gdsf_weight]
    if cfg.policy.duel_scope == "below_gpu":
        host, disk = shared_duel(2, weight)  # the config checked that both tiers exist and name eviction: duel
        return BelowGPUOrders(host, disk)
    if weight == LINEAR:
        return BelowGPUOrders()
    disks = {"lmdb": cfg.disk.eviction, "file": cfg.file.eviction, "slab": cfg.slab.eviction}
    named = [disks[t] for t in cfg.tiers if t in disks]
    return BelowGPUOrders(make_order(cfg.host.eviction, weight), make_order(named[0], weight) if named else None)


def build_lower_tiers(cfg: KVStoreConfig, layout: KVLayout) -> LowerTiers:
    """The tiers named in ``cfg.tiers``, built through the :data:`kvstore.tiers.TIERS` registry.

    The host tier is built with ``auto_evict=False``: the tiered store
    evicts from it itself so it can copy victims to disk first (write-back).
    """
    from kvstore.tiers import build_tier

    sections = {"host": cfg.host, "lmdb": cfg.disk, "file": cfg.file, "slab": cfg.slab, "remote": cfg.remote}
    host: HostTier | None = None
    disk: Tier | None = None
    remote: ChainTier | None = None
    orders = below_gpu_orders(cfg)
    for name in cfg.tiers:
        if name == "host":
            built = build_tier(name, sections[name], layout, auto_evict=False, order=orders.host)
            assert isinstance(built, HostTier)  # the store reserves and pins its slots (the HostTier slot API)
            host = built
        elif name == "remote":
            chained = build_tier(name, sections[name], layout)
            assert isinstance(chained, ChainTier)  # loads and stores go by chain position
            remote = chained
        else:
            disk = build_tier(name, sections[name], layout, order=orders.disk)
    return LowerTiers(host, disk, remote)
