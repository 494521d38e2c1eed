"""Connectors: how an engine reaches kvstore (in-process, or through the sidecar daemon)."""

from __future__ import annotations

from connectors.base import TIER_NAMES, KVConnector, Lease, PrefixMatch
from connectors.embedded import EmbeddedConnector
from kvstore.config.schema import KVStoreConfig


def build_connector(config: KVStoreConfig) -> KVConnector:
    """The connector ``config.connector`` names, not yet registered with a pool."""
    if config.connector == "embedded":
        return EmbeddedConnector(config)
    from connectors.sidecar import SidecarConnector

    return SidecarConnector(config)


__all__ = ["TIER_NAMES", "EmbeddedConnector", "KVConnector", "Lease", "PrefixMatch", "build_connector"]
