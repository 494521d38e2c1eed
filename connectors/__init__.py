"""Connectors: how an engine reaches kvstore (in-process, or through the sidecar daemon).

The API types live in :mod:`connectors.base`; importing it (or this package)
does not import the store, so another store can implement
:class:`KVConnector` without loading kvstore's. ``EmbeddedConnector`` is
imported from :mod:`connectors.embedded` on first use of the name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from connectors.base import TIER_NAMES, KVConnector, Lease, PrefixMatch

if TYPE_CHECKING:
    from connectors.embedded import EmbeddedConnector
    from kvstore.config.schema import KVStoreConfig


def build_connector(config: KVStoreConfig) -> KVConnector:
    """The connector ``config.connector`` names, not yet registered with a pool."""
    if config.connector == "embedded":
        from connectors.embedded import EmbeddedConnector

        return EmbeddedConnector(config)
    from connectors.sidecar import SidecarConnector

    return SidecarConnector(config)


def __getattr__(name: str) -> Any:
    """``connectors.EmbeddedConnector``, imported when first asked for (it loads the whole store)."""
    if name == "EmbeddedConnector":
        from connectors.embedded import EmbeddedConnector

        return EmbeddedConnector
    raise AttributeError(f"module 'connectors' has no attribute {name!r}")


__all__ = ["TIER_NAMES", "EmbeddedConnector", "KVConnector", "Lease", "PrefixMatch", "build_connector"]
