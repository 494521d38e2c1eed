"""Build the lower tiers a config names in ``tiers``."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config.schema import DISK_TIERS, KVStoreConfig
from kvstore.layout import KVLayout
from kvstore.policy.named import TierOrders
from kvstore.tiers.base import Tier
from kvstore.tiers.chain import ChainTier
from kvstore.tiers.host.tier import HostTier


@dataclass(frozen=True)
class LowerTiers:
    """The lower tiers of one store, each ``None`` when ``tiers`` does not name it."""

    host: HostTier | None = None
    disk: Tier | None = None
    remote: ChainTier | None = None


def tier_orders(cfg: KVStoreConfig) -> TierOrders:
    """The host and the disk tier's eviction orders, built by the placement policy ``policy.placement``
    (one shared duel when the policy has one and ``tiers`` names both). The store and the daemon hand them
    to the tiers they build."""
    both = "host" in cfg.tiers and any(name in DISK_TIERS for name in cfg.tiers)
    return cfg.policy.placement_policy().orders(both_tiers=both)


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
    orders = tier_orders(cfg)
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
