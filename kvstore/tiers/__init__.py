"""Tiers below the GPU, a package each: ``host/`` (RAM, L2), ``lmdb/`` (disk, L3), ``slab/`` (the opt-in
O_DIRECT disk tier), ``redis/`` (remote), and ``file.py`` (the file-per-block baseline); what they share
(the interface, data directories, sync loops, the victim hook) sits here.

``TIERS`` maps the YAML name of a tier to a builder taking ``(section, layout)``::

    tier = build_tier("lmdb", config.disk, layout)

The tiers are imported when first named, not with the package: they bring torch (150 MB of a process's
memory), and a daemon serving any layout imports it only when its first layout opens, so an idle daemon
stays small (``tests/daemon/test_idle_memory.py``); a module of the package
(``kvstore.tiers.shared_capacity``) imports without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel

    from kvstore.layout import KVLayout
    from kvstore.tiers.base import Tier, TierEvent, TierRegistry, TierStats
    from kvstore.tiers.file import FileTier
    from kvstore.tiers.host.tier import HostTier
    from kvstore.tiers.lmdb.tier import DiskTier
    from kvstore.tiers.redis.tier import RedisTier
    from kvstore.tiers.slab.tier import SlabTier

_WHERE = {
    "Tier": "kvstore.tiers.base", "TierEvent": "kvstore.tiers.base", "TierRegistry": "kvstore.tiers.base",
    "TierStats": "kvstore.tiers.base", "DiskTier": "kvstore.tiers.lmdb.tier", "FileTier": "kvstore.tiers.file",
    "HostTier": "kvstore.tiers.host.tier", "RedisTier": "kvstore.tiers.redis.tier", "SlabTier": "kvstore.tiers.slab.tier",
}
_registry: list[TierRegistry] = []


def default_tiers() -> TierRegistry:
    """A registry holding ``host``, ``lmdb``, ``file``, ``slab`` and ``remote``, each built by its ``from_config``."""
    from kvstore.tiers.base import TierRegistry
    from kvstore.tiers.file import FileTier
    from kvstore.tiers.host.tier import HostTier
    from kvstore.tiers.lmdb.tier import DiskTier
    from kvstore.tiers.redis.tier import RedisTier
    from kvstore.tiers.slab.tier import SlabTier

    reg = TierRegistry()
    reg.register("host", HostTier.from_config)
    reg.register("lmdb", DiskTier.from_config)
    reg.register("file", FileTier.from_config)
    reg.register("slab", SlabTier.from_config)
    reg.register("remote", RedisTier.from_config)
    return reg


def _tiers() -> TierRegistry:
    """:data:`TIERS`, built on first use."""
    if not _registry:
        _registry.append(default_tiers())
    return _registry[0]


def build_tier(name: str, section: BaseModel, layout: KVLayout, **kwargs: object) -> Tier:
    """Build the tier ``name`` from its config section (``kwargs`` go to its ``from_config``)."""
    return _tiers().create(name, section, layout, **kwargs)


def __getattr__(name: str) -> Any:
    """The tier classes and ``TIERS`` (the tiers known by name), imported on first use."""
    if name == "TIERS":
        return _tiers()
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'kvstore.tiers' has no attribute {name!r}")


if TYPE_CHECKING:
    TIERS: TierRegistry
    """The tiers known by name."""

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
