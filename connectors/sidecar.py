"""``SidecarConnector``: the GPU pool and radix index in the engine, the lower tiers in a ``kvstore serve`` daemon.

The store is the same :class:`~kvstore.store.tiered.TieredStore` the embedded
connector uses, with one lower tier: a :class:`~kvstore.daemon.client.tier.DaemonTier`
(the daemon's shared-memory host tier in front of its disk tier). Lookups
probe the daemon beyond the in-process index, so an engine finds what another
engine (or its own previous run) left there. In the connector API a block
found there is named by the daemon's tier that held it at lookup,
``"daemon:host"`` or ``"daemon:disk"`` (``"daemon:remote"`` when it came from
the daemon's remote tier), in matches and leases; the store's stats show the
daemon tier under ``"daemon"``, its hits by the same names. The daemon
manages its tiers, so ``offload("host")`` moves nothing here and
``offload("gpu")`` moves unused GPU blocks into the daemon.

Tenant salt: when the daemon assigns one to this client's token
(``daemon.tenant_salts``), every key is computed with it and a salt passed by
the caller is ignored: the trusted side decides the tenant.

Durability: ``close`` (and ``store.flush``) raise :class:`~kvstore.errors.NotDurable`
when the daemon reports blocks it acknowledged that did not reach its disk.
"""

from __future__ import annotations

import os

from connectors.base import DAEMON_TIERS
from connectors.embedded import EmbeddedConnector
from kvstore.config.schema import KVStoreConfig
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.hashing import Salt
from kvstore.store.tiered import TieredStore
from kvstore.daemon.client.tier import DaemonTier

CONNECT_WAIT_S = 10.0
"""How long :meth:`SidecarConnector.register` waits for the daemon to answer."""


class SidecarConnector(EmbeddedConnector):
    """Connector whose host and disk tiers are the daemon's at ``config.daemon.socket_path``."""

    tier_names = DAEMON_TIERS  # a daemon hit is named by the daemon's tier: daemon:host, daemon:disk
    lower_section = "daemon"

    def __init__(self, config: KVStoreConfig | None = None, client_name: str | None = None) -> None:
        super().__init__(config)
        self.client_name = client_name or f"engine pid {os.getpid()}"
        self._tier: DaemonTier | None = None

    def _build_store(self, pool: GPUBlockPool) -> TieredStore:
        """Connect to the daemon with the pool's layout (the daemon checks its fingerprint), then build the store.

        Raises :class:`~kvstore.daemon.client.connection.DaemonUnavailable` if no daemon
        answers within :data:`CONNECT_WAIT_S`, and
        :class:`~kvstore.daemon.wire.frames.DaemonError` if it refuses the handshake
        (wrong token, different layout).
        """
        self._tier = DaemonTier.from_config(self.config, self.client_name, CONNECT_WAIT_S, pool.layout)
        return TieredStore(pool.layout, pool, host=None, disk=self._tier, policy=self.config.policy,
                           deadlines=self.config.deadlines)

    def daemon_health(self) -> dict[str, object] | None:
        """The daemon tier's breaker, misses by operation and reason, and measured load bandwidth
        (:meth:`~kvstore.daemon.client.tier.DaemonTier.health`; ``None`` before :meth:`register`)."""
        return self._tier.health() if self._tier is not None else None

    @property
    def tenant_salt(self) -> bytes | None:
        """The salt the daemon assigned at handshake (``None``: callers' salts are used as given)."""
        return self._tier.salt if self._tier is not None else None

    def effective_salt(self, salt: Salt) -> Salt:
        """The daemon-assigned salt when there is one (the trusted side decides the tenant), else ``salt``."""
        forced = self.tenant_salt
        return forced if forced is not None else salt
