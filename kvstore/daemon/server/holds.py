"""Which client holds which host slot, and until when.

A *hold* is one reference a connection keeps on a host-tier slot, by key:

- ``read``: a locked, published slot the client copies out of (GET_SHM);
  ended by RELEASE (unlock).
- ``write``: a reserved slot the client writes into (PUT_SHM_RESERVE); ended
  by PUT_SHM_COMMIT (publish) or RELEASE (abort).

Every hold expires ``timeout_s`` after it was granted, whether or not the
client is still connected: a client that vanishes (crash, ``kill -9``, a
broken socket) never pins host memory forever. When the daemon knows the
client's process is gone, it ends all of that owner's holds at once
(:meth:`HoldTable.take_all`): a dead process copies nothing. A well-behaved client treats
a hold older than half the timeout as void (see ``DaemonClient``), so an
expired slot is never read or written after the daemon reused it.

Plain containers: per (owner, kind) a dict from key to the deadlines of its
references, oldest first. The table is only touched from the event loop
thread, under a lock anyway because executor threads read its size.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

HoldKind = Literal["read", "write"]

HOLDS_PER_SLOT = 2
"""Most hold references one connection may have, per host slot: more means it holds the same slots again
and again without releasing them (each reference costs the daemon bookkeeping until its deadline)."""


@dataclass(frozen=True)
class Hold:
    """A hold that ended without RELEASE or COMMIT (deadline passed, or its holder died):
    the daemon must unlock (read) or abort (write) ``key``."""

    owner: int
    kind: HoldKind
    key: bytes


class HoldTable:
    """Per-connection hold bookkeeping with deadlines."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._held: dict[tuple[int, HoldKind], dict[bytes, list[float]]] = {}
        self._count: dict[int, int] = {}  # owner -> references it has now (checked on every grant)
        self._lock = threading.Lock()
        self.expired_total = 0
        """Holds ended by their deadline (a counter for metrics)."""

    def grant(self, owner: int, kind: HoldKind, keys: Sequence[bytes], now: float) -> None:
        """Record one reference of ``kind`` per key for ``owner``, expiring at ``now + timeout_s``."""
        deadline = now + self.timeout_s
        with self._lock:
            table = self._held.setdefault((owner, kind), {})
            for key in keys:
                table.setdefault(key, []).append(deadline)
            self._count[owner] = self._count.get(owner, 0) + len(keys)

    def take(self, owner: int, kind: HoldKind, keys: Sequence[bytes]) -> list[bool]:
        """Remove one reference per key; ``result[i]`` says whether ``owner`` held one to remove."""
        out: list[bool] = []
        with self._lock:
            table = self._held.get((owner, kind), {})
            for key in keys:
                refs = table.get(key)
                if not refs:
                    out.append(False)
                    continue
                refs.pop(0)
                if not refs:
                    del table[key]
                out.append(True)
            if not table:
                self._held.pop((owner, kind), None)
            self._uncount(owner, sum(out))
        return out

    def has(self, owner: int, kind: HoldKind, key: bytes) -> bool:
        """Whether ``owner`` has at least one ``kind`` hold on ``key``. Changes nothing."""
        with self._lock:
            return bool(self._held.get((owner, kind), {}).get(key))

    def take_all(self, owner: int) -> list[Hold]:
        """Remove and return every hold ``owner`` has (one entry per reference), whatever its deadline."""
        out: list[Hold] = []
        with self._lock:
            for kind in ("read", "write"):
                table = self._held.pop((owner, kind), {})
                for key, refs in table.items():
                    out.extend(Hold(owner, kind, key) for _ in refs)
            self._count.pop(owner, None)
        return out

    def expire(self, now: float) -> list[Hold]:
        """Remove and return every hold whose deadline is ``<= now``."""
        out: list[Hold] = []
        with self._lock:
            for (owner, kind), table in list(self._held.items()):
                for key, refs in list(table.items()):
                    while refs and refs[0] <= now:
                        refs.pop(0)
                        out.append(Hold(owner, kind, key))
                        self._uncount(owner, 1)
                    if not refs:
                        del table[key]
                if not table:
                    del self._held[(owner, kind)]
            self.expired_total += len(out)
        return out

    def keys_held(self, kind: HoldKind) -> dict[int, int]:
        """Owner -> how many keys it has ``kind`` holds on now (a write hold is one per key: a key reserved
        is not reserved again). Changes nothing."""
        with self._lock:
            return {owner: len(table) for (owner, k), table in self._held.items() if k == kind}

    def owned_by(self, owner: int) -> int:
        """References ``owner`` has now. Changes nothing."""
        with self._lock:
            return self._count.get(owner, 0)

    def _uncount(self, owner: int, n: int) -> None:
        left = self._count.get(owner, 0) - n
        if left > 0:
            self._count[owner] = left
        else:
            self._count.pop(owner, None)

    def __len__(self) -> int:
        """References held by all owners."""
        with self._lock:
            return sum(len(r) for t in self._held.values() for r in t.values())
