"""Tiers below the GPU, a package each: ``host/`` (RAM, L2), ``lmdb/`` (disk, L3), ``slab/`` (the opt-in
O_DIRECT disk tier), ``redis/`` (remote), and ``file.py`` (the file-per-block baseline); what they share
(the interface, data directories, sync loops, the victim hook) sits here.

``TIERS`` maps the YAML name of a tier to a builder taking ``(section, layout)``::

    tier = build_tier("lmdb", config.disk, layout)
"""

from __future__ import annotations

from pydantic import BaseModel

from kvstore.layout import KVLayout
from kvstore.tiers.base import Tier, TierEvent, TierRegistry, TierStats
from kvstore.tiers.lmdb.tier import DiskTier
from kvstore.tiers.file import FileTier
from kvstore.tiers.host.tier import HostTier
from kvstore.tiers.redis.tier import RedisTier
from kvstore.tiers.slab.tier import SlabTier


def default_tiers() -> TierRegistry:
    """A registry holding ``host``, ``lmdb``, ``file``, ``slab`` and ``remote``, each built by its ``from_config``."""
    reg = TierRegistry()
    reg.register("host", HostTier.from_config)
    reg.register("lmdb", DiskTier.from_config)
    reg.register("file", FileTier.from_config)
    reg.register("slab", SlabTier.from_config)
    reg.register("remote", RedisTier.from_config)
    return reg


TIERS = default_tiers()
"""The tiers known by name."""


def build_tier(name: str, section: BaseModel, layout: KVLayout, **kwargs: object) -> Tier:
    """Build the tier ``name`` from its config section (``kwargs`` go to its ``from_config``)."""
    return TIERS.create(name, section, layout, **kwargs)


__all__ = [
    "TIERS",
    "DiskTier",
    "FileTier",
    "HostTier",
    "RedisTier",
    "SlabTier",
    "Tier",
    "TierEvent",
    "TierRegistry",
    "TierStats",
    "build_tier",
]
