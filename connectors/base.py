"""The connector API: the boundary between an inference engine and kvstore.

An engine registers its GPU block pool once, then per request::

    match = connector.lookup(tokens, salt)      # how much is cached, by tier
    lease = connector.acquire(match)            # GPU blocks for it, loading
    cached = lease.resolve()                    # stop policy applied
    ... compute tokens[cached:], calling lease.wait_layer(i) before layer i ...
    connector.commit(tokens, block_ids, salt)   # full blocks as they fill
    connector.release(lease); connector.free(own_blocks)

Two implementations share this interface: :class:`~connectors.embedded.EmbeddedConnector`
(the store lives in the engine's process) and
:class:`~connectors.sidecar.SidecarConnector` (host and disk tiers live in a
``kvstore serve`` daemon). Which one is a config setting (``connector:``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from kvstore.gpu_pool import GPUBlockPool
from kvstore.hashing import Salt
from kvstore.layout import KVLayout
from kvstore.prefetch import Lease
from kvstore.store import PrefixMatch

__all__ = ["KVConnector", "Lease", "PrefixMatch"]


class KVConnector(ABC):
    """What an engine needs from a KV cache store. Each method says what it changes."""

    @abstractmethod
    def register(self, pool: GPUBlockPool) -> None:
        """Attach the engine's GPU block pool (and so its KV layout). Call once, before anything else."""

    @property
    @abstractmethod
    def layout(self) -> KVLayout:
        """The registered layout."""

    @abstractmethod
    def keys(self, tokens: Sequence[int], salt: Salt = None, parent: bytes | None = None) -> list[bytes]:
        """Block keys of the full blocks of ``tokens`` (continuing ``parent`` if given). Pure."""

    @abstractmethod
    def lookup(self, tokens: Sequence[int], salt: Salt = None) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` in any tier. Changes access order and hit counters only."""

    @abstractmethod
    def lookup_keys(self, keys: Sequence[bytes], prompt_tokens: int | None = None) -> PrefixMatch:
        """:meth:`lookup` for precomputed keys."""

    @abstractmethod
    def acquire(self, match: PrefixMatch) -> Lease:
        """Lock the GPU hits of ``match``, allocate GPU blocks for its lower-tier hits and start loading them.

        Never blocks on I/O. The lease may cover fewer blocks than matched
        (``Lease.shortfall`` says why).
        """

    @abstractmethod
    def release(self, lease: Lease) -> None:
        """Give back a lease: cancel unfinished loads, drop its GPU references, unlock its blocks."""

    @abstractmethod
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` GPU blocks for new tokens (evicting unused cached blocks if needed).

        Raises :class:`kvstore.errors.OutOfBlocks` and takes nothing when it cannot.
        """

    @abstractmethod
    def free(self, block_ids: Sequence[int]) -> None:
        """Drop the engine's reference on each block; cached blocks stay cached."""

    @abstractmethod
    def commit(self, tokens: Sequence[int], block_ids: Sequence[int], salt: Salt = None) -> int:
        """Cache the full blocks of ``tokens`` held in ``block_ids`` (from the first block). Returns how many were new."""

    @abstractmethod
    def commit_keys(self, keys: Sequence[bytes], block_ids: Sequence[int], tokens: Sequence[int] | None = None,
                    salt: Salt = None) -> int:
        """:meth:`commit` for precomputed keys (``tokens``, when given, make later lookups hash-free)."""

    @abstractmethod
    def save(self, keys: Sequence[bytes]) -> int:
        """Copy these cached blocks down to the host tier now (preemption by swap); returns how many are there."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Per-tier counters and occupancy. Changes nothing."""

    @abstractmethod
    def close(self) -> None:
        """Flush durable tiers and release every resource."""
