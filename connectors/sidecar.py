"""``SidecarConnector``: the GPU pool and radix index in the engine, the lower tiers in a ``kvstore serve`` daemon.

The store is the same :class:`~kvstore.store.TieredStore` the embedded
connector uses, with one lower tier: a :class:`~kvstore.tiers.remote.DaemonTier`
(the daemon's shared-memory host tier in front of its disk tier). Lookups
probe the daemon beyond the in-process index, so an engine finds what another
engine (or its own previous run) left there.

Tenant salt: when the daemon assigns one to this client's token
(``daemon.tenant_salts``), every key is computed with it and a salt passed by
the caller is ignored: the trusted side decides the tenant.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from connectors.embedded import EmbeddedConnector
from kvstore.config.schema import KVStoreConfig
from kvstore.daemon.client import DaemonClient
from kvstore.gpu_pool import GPUBlockPool
from kvstore.hashing import Salt, block_keys
from kvstore.store import PrefixMatch, TieredStore
from kvstore.tiers.remote import DaemonTier

CONNECT_WAIT_S = 10.0
"""How long :meth:`SidecarConnector.register` waits for the daemon to answer."""


class SidecarConnector(EmbeddedConnector):
    """Connector whose host and disk tiers are the daemon's at ``config.daemon.socket_path``."""

    def __init__(self, config: KVStoreConfig | None = None, client_name: str | None = None) -> None:
        super().__init__(config)
        self.client_name = client_name or f"engine pid {os.getpid()}"
        self._tier: DaemonTier | None = None

    def _build_store(self, pool: GPUBlockPool) -> TieredStore:
        """Connect to the daemon with the pool's layout (the daemon checks its fingerprint), then build the store.

        Raises :class:`~kvstore.daemon.client.DaemonUnavailable` if no daemon
        answers within :data:`CONNECT_WAIT_S`, and
        :class:`~kvstore.daemon.frames.DaemonError` if it refuses the handshake
        (wrong token, different layout).
        """
        d = self.config.daemon
        client = DaemonClient(pool.layout, socket_path=d.socket_path, token=d.token, client_name=self.client_name)
        client.connect(CONNECT_WAIT_S)
        self._tier = DaemonTier(pool.layout, client)
        return TieredStore(pool.layout, pool, host=None, disk=self._tier, policy=self.config.policy)

    @property
    def tenant_salt(self) -> bytes | None:
        """The salt the daemon assigned at handshake (``None``: callers' salts are used as given)."""
        return self._tier.salt if self._tier is not None else None

    def keys(self, tokens: Sequence[int], salt: Salt = None, parent: bytes | None = None) -> list[bytes]:
        """Block keys, rooted in the daemon-assigned salt when there is one (else ``salt``). Pure."""
        forced = self.tenant_salt
        return block_keys(tokens, self.layout, forced if forced is not None else salt, parent=parent)

    def lookup(self, tokens: Sequence[int], salt: Salt = None) -> PrefixMatch:
        """Longest cached prefix in the engine's GPU or the daemon's tiers. Changes access order and counters."""
        return self.store.lookup_keys(self.keys(tokens, salt), prompt_tokens=len(tokens))

    def commit(self, tokens: Sequence[int], block_ids: Sequence[int], salt: Salt = None) -> int:
        """Cache the full blocks of ``tokens``; the write policy copies them to the daemon."""
        keys = self.keys(tokens, salt)
        return self.store.commit(keys, list(block_ids)[: len(keys)])
