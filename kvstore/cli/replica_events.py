"""A replica's KV events: the config's ``events`` section plus the command-line overrides, published or off."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connectors.base import KVConnector
    from kvstore.config.schema import KVStoreConfig
    from kvstore.route.publisher import EventPublisher


class ReplicaEvents:
    """The publisher of one engine replica's store events, or nothing when events are off."""

    def __init__(self, publisher: EventPublisher | None, endpoint: str | None, replay_endpoint: str | None) -> None:
        self.publisher = publisher
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint

    @classmethod
    def start(cls, cfg: KVStoreConfig, connector: KVConnector, replica: str, endpoint: str | None,
              replay_endpoint: str | None) -> ReplicaEvents:
        """Publish ``connector``'s store events as ``cfg.events`` says, ``endpoint``/``replay_endpoint`` overriding.

        Both kvstore connectors have a store in this process (the sidecar's
        indexes the daemon's blocks as its ``disk`` tier); raises ``ValueError``
        for a connector without one.
        """
        from connectors.embedded import EmbeddedConnector
        from kvstore.config.events import events_override
        from kvstore.route.publisher import attach_publisher

        events = events_override(cfg.events, endpoint, replay_endpoint, replica_id=replica)
        if not events.enabled:
            return cls(None, None, None)
        if not isinstance(connector, EmbeddedConnector):
            raise ValueError(f"events.enabled needs a kvstore connector (embedded or sidecar), not "
                             f"{type(connector).__name__}")
        publisher = attach_publisher(connector.store, events)
        return cls(publisher, publisher.endpoint, publisher.replay_endpoint)

    def banner(self) -> str:
        """What the start-up line adds: where events go."""
        if self.publisher is None:
            return ""
        replay = f", replay on {self.replay_endpoint}" if self.replay_endpoint else ""
        return f"; KV events on {self.endpoint}{replay}"

    def stats(self) -> dict[str, Any]:
        """The ``events`` section of the engine server's ``/stats`` and ``/metrics``."""
        if self.publisher is None:
            return {"events": {"enabled": False}}
        p = self.publisher
        return {"events": {"enabled": True, "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                           "last_seq": p.last_seq, "replays_served": p.replays_served,
                           "reports_served": p.reports_served, "reports_built": p.reports_built}}

    def close(self) -> None:
        """Stop publishing (publishes nothing more)."""
        if self.publisher is not None:
            self.publisher.close()
