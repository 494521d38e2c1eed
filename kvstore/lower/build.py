"""Build the lower tiers a config names in ``tiers``: the one place tiers are made from config.

The embedded store (:meth:`kvstore.store.tiered.TieredStore.from_config`), the daemon (one set per layout it
serves), the engine adapters' embedded store and the SGLang backend all build theirs here, so each gets
the tiers the config names with the eviction orders of its placement policy (``policy.placement``). What
differs between them is not in the config, and is said by a :class:`HostPlan`: who evicts from the host
tier, whether its arena is shared, whether it exists when ``tiers`` does not name it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config.schema import DISK_TIERS, DiskConfig, FileConfig, KVStoreConfig, SlabConfig
from kvstore.layout import KVLayout
from kvstore.policy.named import TierOrders
from kvstore.tiers.base import Tier
from kvstore.tiers.chain import ChainTier
from kvstore.tiers.host.arena import PinMode
from kvstore.tiers.host.tier import HostTier
from kvstore.tiers.shared_capacity import SharedCapacity


@dataclass(frozen=True)
class LowerTiers:
    """The lower tiers of one store, each ``None`` when not built."""

    host: HostTier | None = None
    disk: Tier | None = None
    remote: ChainTier | None = None

    def close(self) -> None:
        """Close every tier built (a failed start frees its arena and files now, not at interpreter exit)."""
        for tier in (self.remote, self.disk, self.host):
            if tier is not None:
                tier.close()


@dataclass(frozen=True)
class HostPlan:
    """How the owner of the tiers uses its host tier: what the config does not say.

    The embedded store evicts from the host tier itself, so it can copy victims to disk first
    (``auto_evict=False``); the daemon and the in-process stack let it evict on its own and write through
    behind it. The daemon's host tier always exists (its shared arena is the data plane), and is shared
    under ``label``."""

    auto_evict: bool = False
    always: bool = False
    """Build the host tier even when ``tiers`` does not name it."""
    shared_memory: bool | None = None
    """Map the arena in shared memory (``None``: ``host.shared_memory``)."""
    label: str = "kvstore-host"
    pin_memory: PinMode | None = None
    """``None``: ``host.pin_memory``."""
    shared_capacity: SharedCapacity | None = None
    """A budget several layouts' host tiers share (a daemon serving any layout)."""
    max_slots: int | None = None


EMBEDDED = HostPlan()
"""The embedded store's host tier: as configured, evicted by the store's placement."""
IN_PROCESS = HostPlan(auto_evict=True, always=True, shared_memory=False)
"""The in-process stack's (:mod:`kvstore.lower.local`): evicting on its own, private, always there."""


def tier_orders(cfg: KVStoreConfig, host_always: bool = False) -> TierOrders:
    """The host and the disk tier's eviction orders, built by the placement policy ``policy.placement``
    (one shared duel when the policy has one and both a host and a disk tier exist)."""
    both = ("host" in cfg.tiers or host_always) and any(name in DISK_TIERS for name in cfg.tiers)
    return cfg.policy.placement_policy().orders(both_tiers=both)


def disk_tier_name(cfg: KVStoreConfig) -> str | None:
    """The disk tier ``tiers`` names (``lmdb``, ``file`` or ``slab``), if any (the schema allows at most one)."""
    return next((name for name in cfg.tiers if name in DISK_TIERS), None)


def disk_section(cfg: KVStoreConfig) -> DiskConfig | FileConfig | SlabConfig | None:
    """The config section of the disk tier ``tiers`` names, if any."""
    name = disk_tier_name(cfg)
    sections: dict[str, DiskConfig | FileConfig | SlabConfig] = {"lmdb": cfg.disk, "file": cfg.file, "slab": cfg.slab}
    return None if name is None else sections[name]


def build_lower_tiers(cfg: KVStoreConfig, layout: KVLayout, host: HostPlan = EMBEDDED, *,
                      disk_capacity: SharedCapacity | None = None, remote: bool = True) -> LowerTiers:
    """The tiers ``cfg.tiers`` names (and the host tier when ``host.always``), built through the
    :data:`kvstore.tiers.TIERS` registry with ``policy.placement``'s orders, fastest first; each one
    built is closed again if a later one fails to open.

    ``disk_capacity``: a disk budget several layouts share (the daemon under ``daemon.layouts: any``).
    ``remote``: build the remote tier when ``tiers`` names it (the daemon links it to its stack itself).
    """
    from kvstore.tiers import build_tier

    orders = tier_orders(cfg, host.always)
    built: dict[str, Tier] = {}
    try:
        if "host" in cfg.tiers or host.always:
            built["host"] = HostTier(
                layout, int(cfg.host.capacity),
                pin_memory=cfg.host.pin_memory if host.pin_memory is None else host.pin_memory,
                shared_memory=cfg.host.shared_memory if host.shared_memory is None else host.shared_memory,
                label=host.label, auto_evict=host.auto_evict, order=orders.host, prefault=cfg.host.prefault,
                shared_capacity=host.shared_capacity, max_slots=host.max_slots)
        name, section = disk_tier_name(cfg), disk_section(cfg)
        if name is not None and section is not None:
            extra = {} if disk_capacity is None else {"shared_capacity": disk_capacity}
            built["disk"] = build_tier(name, section, layout, order=orders.disk, **extra)
        if remote and "remote" in cfg.tiers:
            built["remote"] = build_tier("remote", cfg.remote, layout)
    except BaseException:
        LowerTiers(**built).close()  # type: ignore[arg-type]
        raise
    assert isinstance(built.get("remote"), (ChainTier, type(None)))  # loads and stores go by chain position
    return LowerTiers(**built)  # type: ignore[arg-type]
