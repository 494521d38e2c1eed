"""Build the lower tiers a config names in ``tiers``."""

from __future__ import annotations

from kvstore.config.schema import KVStoreConfig
from kvstore.layout import KVLayout
from kvstore.tiers.base import Tier
from kvstore.tiers.host import HostTier


def build_lower_tiers(cfg: KVStoreConfig, layout: KVLayout) -> tuple[HostTier | None, Tier | None]:
    """``(host, disk)`` for the names in ``cfg.tiers``; either may be ``None``.

    Tiers are created through the :data:`kvstore.tiers.TIERS` registry by
    name. The host tier is built with ``auto_evict=False``: the tiered store
    evicts from it itself so it can copy victims to disk first (write-back).
    """
    from kvstore.tiers import build_tier

    sections = {"host": cfg.host, "lmdb": cfg.disk, "file": cfg.file}
    host: HostTier | None = None
    disk: Tier | None = None
    for name in cfg.tiers:
        if name == "host":
            built = build_tier(name, sections[name], layout, auto_evict=False)
            assert isinstance(built, HostTier)  # the store reserves and pins its slots (the HostTier slot API)
            host = built
        else:
            disk = build_tier(name, sections[name], layout)
    return host, disk
