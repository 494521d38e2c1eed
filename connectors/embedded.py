"""``EmbeddedConnector``: the tiered store in the engine's own process.

The store's match and prefetch lease are its own types; this module adapts
them to the connector API's :class:`~connectors.base.PrefixMatch` (the
store's match rides along as the opaque handle) and
:class:`~connectors.base.Lease` (:class:`EmbeddedLease` wraps the store's
prefetch job), so nothing outside ``connectors/`` sees store internals and
the store core imports nothing from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from connectors.base import LOCAL_TIERS, KVConnector, Lease, PrefixMatch
from kvstore.config.schema import KVStoreConfig
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.hashing import Salt, block_keys
from kvstore.layout import KVLayout
from kvstore.store.tiered import TieredStore

if TYPE_CHECKING:
    from kvstore.route.publisher import EventPublisher


class _StoreLease(Protocol):
    """What :class:`EmbeddedLease` uses of the lease ``TieredStore.acquire`` returns."""

    @property
    def block_ids(self) -> list[int]: ...
    @property
    def shortfall(self) -> str | None: ...
    @property
    def load_wait_s(self) -> float: ...
    def resolve(self) -> int: ...
    def wait_layer(self, layer: int) -> None: ...
    def wait(self) -> None: ...
    def tokens_by_tier(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class _MatchHandle:
    """:attr:`PrefixMatch.handle` of an embedded match: the store's own match and the connector that made it."""

    owner: EmbeddedConnector
    store_match: Any


class EmbeddedLease(Lease):
    """A store prefetch lease seen through the connector API (every call goes to the store's lease)."""

    def __init__(self, owner: EmbeddedConnector, inner: _StoreLease) -> None:
        self._owner = owner
        self._inner = inner

    @property
    def block_ids(self) -> list[int]:
        return self._inner.block_ids

    @property
    def shortfall(self) -> str | None:
        return self._inner.shortfall

    @property
    def load_wait_s(self) -> float:
        return self._inner.load_wait_s

    def resolve(self) -> int:
        return self._inner.resolve()

    def wait_layer(self, layer: int) -> None:
        self._inner.wait_layer(layer)

    def wait(self) -> None:
        self._inner.wait()

    def tokens_by_tier(self) -> dict[str, int]:
        out = dict.fromkeys(self._owner.tier_names, 0)
        for t, n in self._inner.tokens_by_tier().items():
            if n or t in out:  # the store's own names for tiers this connector has none of (a sidecar's disk)
                out[t] = out.get(t, 0) + n
        return out


class EmbeddedConnector(KVConnector):
    """Connector over a :class:`TieredStore` built at :meth:`register` from ``config``'s tiers and policies.

    The engine's pool defines the layout (the config's ``model`` section is
    for the daemon, which has no model); tiers, sizes and policies come from
    the config.
    """

    tier_names: tuple[str, ...] = LOCAL_TIERS
    """The tiers of this connector's matches and leases (:attr:`PrefixMatch.tier_names`; the sidecar's are the
    daemon's). The store names each block's tier itself (:attr:`~kvstore.store.match.StoreMatch.labels`)."""
    lower_section = "disk"
    """The key of the store's lowest tier in :meth:`stats` (the sidecar's is the daemon)."""

    def __init__(self, config: KVStoreConfig | None = None) -> None:
        self.config = config or KVStoreConfig()
        self._store: TieredStore | None = None
        self._events: EventPublisher | None = None

    # ----------------------------------------------------------------- setup
    def register(self, pool: GPUBlockPool) -> None:
        if self._store is not None:
            raise RuntimeError("EmbeddedConnector.register called twice")
        self._store = self._build_store(pool)
        if self.config.events.enabled:  # a router follows this replica (``events:``; kvstore/route)
            from kvstore.route.publisher import attach_publisher  # pyzmq only where events are on

            self._events = attach_publisher(self._store, self.config.events)

    def _build_store(self, pool: GPUBlockPool) -> TieredStore:
        """The store over ``pool`` (the sidecar connector overrides this to use the daemon's tiers)."""
        return TieredStore.from_config(self.config, pool=pool)

    @property
    def store(self) -> TieredStore:
        """The underlying store (after :meth:`register`), for tests that check its internals; engines use the API."""
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
        m = self.store.lookup(tokens, self.effective_salt(salt))
        return PrefixMatch(tuple(m.keys), m.labels, m.block_size, m.prompt_tokens, handle=_MatchHandle(self, m),
                           tier_names=self.tier_names)

    def acquire(self, match: PrefixMatch, window: int = 0) -> Lease:
        handle = match.handle
        if not isinstance(handle, _MatchHandle):
            raise TypeError(f"acquire: the match's handle is {type(handle).__name__}, not an embedded "
                            f"connector's; pass the PrefixMatch this connector's lookup returned")
        if handle.owner is not self:
            raise ValueError("acquire: the match was made by another connector")
        return EmbeddedLease(self, self.store.acquire(handle.store_match, window))

    def release(self, lease: Lease) -> None:
        if not isinstance(lease, EmbeddedLease):
            raise TypeError(f"release: expected the EmbeddedLease this connector's acquire returned, "
                            f"got {type(lease).__name__}")
        if lease._owner is not self:
            raise ValueError("release: the lease was acquired from another connector")
        self.store.release(lease._inner)  # type: ignore[arg-type]

    # ---------------------------------------------------------------- blocks
    def allocate(self, n: int) -> list[int]:
        return self.store.allocate(n)

    def free(self, block_ids: Sequence[int]) -> None:
        self.store.free(block_ids)

    def commit_keys(self, keys: Sequence[bytes], block_ids: Sequence[int], tokens: Sequence[int] | None = None,
                    salt: Salt = None) -> int:
        return self.store.commit(keys, block_ids, tokens, self.effective_salt(salt))

    def save(self, keys: Sequence[bytes]) -> int:
        return self.store.save(keys)

    def offload(self, tier: str) -> int:
        return self.store.offload(tier)

    def flush(self) -> None:
        self.store.flush()

    # ------------------------------------------------------------------ misc
    def stats(self) -> dict[str, Any]:
        """The store's stats, its lowest tier's section under :attr:`lower_section`."""
        out = self.store.stats()
        if "disk" in out and self.lower_section != "disk":
            out[self.lower_section] = out.pop("disk")
        return out

    def close(self) -> None:
        if self._events is not None:  # first: it drains the store's last events
            self._events.close()
            self._events = None
        if self._store is not None:
            self._store.close()
