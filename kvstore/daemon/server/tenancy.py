"""Tenants: the daemon, never the client, decides which namespace a connection's keys live in.

A connection that logged in with a token of ``daemon.tenant_salts`` is that
tenant. Every key it sends is mapped, before any backend call, to::

    BLAKE2b-256(key, key=tenant_id, person="kvstore-tenant")     tenant_id = BLAKE2b-256(salt)

so one tenant's keys and another's (or an untenanted client's) are disjoint
sets: reaching a block of another namespace would take a BLAKE2b preimage.
Replies are positional, so nothing is mapped back. Untenanted clients (local
ones without a token, holders of ``daemon.token``) use keys as sent. The salt
is still handed to the client for its hash chain (defense in depth: even a
daemon misconfigured to share a namespace keeps tenants' keys apart).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

_PERSON = b"kvstore-tenant"


@dataclass
class TenantCounters:
    """What one tenant did (all a tenant's STATS shows of the daemon's counters).

    Requests of one tenant run on several executor threads at once, so counts change only through
    :meth:`add`, under the lock.
    """

    requests: int = 0
    keys_probed: int = 0
    blocks_found: int = 0
    blocks_missed: int = 0
    blocks_stored: int = 0
    blocks_deleted: int = 0
    _mu: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        """Add ``deltas`` (counter name -> amount) atomically."""
        with self._mu:
            for name, n in deltas.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for JSON). Changes nothing."""
        with self._mu:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


@dataclass(frozen=True)
class Tenant:
    """One tenant's namespace. ``label`` names it in logs and stats without showing its salt."""

    tenant_id: bytes
    label: str

    @classmethod
    def from_salt(cls, salt: str) -> Tenant:
        """The tenant a salt of ``daemon.tenant_salts`` stands for (tokens with the same salt share it)."""
        tid = hashlib.blake2b(salt.encode(), digest_size=32, person=_PERSON).digest()
        return cls(tid, tid[:4].hex())

    def keys(self, keys: Sequence[bytes]) -> tuple[bytes, ...]:
        """``keys`` mapped into this tenant's namespace, in order. Pure."""
        return tuple(hashlib.blake2b(k, digest_size=32, key=self.tenant_id, person=_PERSON).digest() for k in keys)
