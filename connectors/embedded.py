"""``EmbeddedConnector``: the tiered store in the engine's own process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from connectors.base import KVConnector
from kvstore.config.schema import KVStoreConfig
from kvstore.gpu_pool import GPUBlockPool
from kvstore.hashing import Salt, block_keys
from kvstore.layout import KVLayout
from kvstore.prefetch import Lease
from kvstore.store import PrefixMatch, TieredStore


class EmbeddedConnector(KVConnector):
    """Connector over a :class:`TieredStore` built at :meth:`register` from ``config``'s tiers and policies.

    The engine's pool defines the layout (the config's ``model`` section is
    for the daemon, which has no model); tiers, sizes and policies come from
    the config.
    """

    def __init__(self, config: KVStoreConfig | None = None) -> None:
        self.config = config or KVStoreConfig()
        self._store: TieredStore | None = None

    # ----------------------------------------------------------------- setup
    def register(self, pool: GPUBlockPool) -> None:
        if self._store is not None:
            raise RuntimeError("EmbeddedConnector.register called twice")
        self._store = self._build_store(pool)

    def _build_store(self, pool: GPUBlockPool) -> TieredStore:
        """The store over ``pool`` (the sidecar connector overrides this to use the daemon's tiers)."""
        return TieredStore.from_config(self.config, pool=pool)

    @property
    def store(self) -> TieredStore:
        """The underlying store (after :meth:`register`)."""
        if self._store is None:
            raise RuntimeError("connector used before register(pool)")
        return self._store

    @property
    def layout(self) -> KVLayout:
        return self.store.layout

    # ---------------------------------------------------------------- lookup
    def effective_salt(self, salt: Salt) -> Salt:
        """The salt keys are made with: the caller's here (the sidecar lets the daemon decide)."""
        return salt

    def keys(self, tokens: Sequence[int], salt: Salt = None, parent: bytes | None = None) -> list[bytes]:
        return block_keys(tokens, self.layout, self.effective_salt(salt), parent=parent)

    def lookup(self, tokens: Sequence[int], salt: Salt = None) -> PrefixMatch:
        return self.store.lookup(tokens, self.effective_salt(salt))

    def lookup_keys(self, keys: Sequence[bytes], prompt_tokens: int | None = None) -> PrefixMatch:
        return self.store.lookup_keys(keys, prompt_tokens)

    def acquire(self, match: PrefixMatch) -> Lease:
        return self.store.acquire(match)

    def release(self, lease: Lease) -> None:
        self.store.release(lease)

    # ---------------------------------------------------------------- blocks
    def allocate(self, n: int) -> list[int]:
        return self.store.allocate(n)

    def free(self, block_ids: Sequence[int]) -> None:
        self.store.free(block_ids)

    def commit(self, tokens: Sequence[int], block_ids: Sequence[int], salt: Salt = None) -> int:
        keys = self.keys(tokens, salt)
        n = len(keys)
        return self.store.commit(keys, list(block_ids)[:n], list(tokens)[: n * self.layout.block_size],
                                 self.effective_salt(salt))

    def commit_keys(self, keys: Sequence[bytes], block_ids: Sequence[int], tokens: Sequence[int] | None = None,
                    salt: Salt = None) -> int:
        return self.store.commit(keys, block_ids, tokens, self.effective_salt(salt))

    def save(self, keys: Sequence[bytes]) -> int:
        return self.store.save(keys)

    # ------------------------------------------------------------------ misc
    def stats(self) -> dict[str, Any]:
        return self.store.stats()

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
