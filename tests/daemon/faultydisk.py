"""A disk tier whose writes can be made to fail (ENOSPC) or to wait, around a real LMDB tier; and a backend on it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import lmdb

from daemonlib import LAYOUT
from kvstore.daemon.server.backend import DaemonBackend
from kvstore.daemon.server.holds import HoldTable
from kvstore.lower.write_policy import WriteRule
from kvstore.tiers.base import Buffer, Tier
from kvstore.tiers.lmdb.tier import DiskTier
from kvstore.tiers.host.tier import HostTier


class FaultyDisk(Tier):
    """Delegates to ``inner``; ``mode`` ``"raise"`` makes ``put`` raise as LMDB does on a full filesystem,
    ``"refuse"`` makes it return ``False`` for every key; ``gate``, when set, holds each ``put`` until it is set."""

    name = "lmdb"

    def __init__(self, inner: DiskTier) -> None:
        super().__init__(inner.layout)
        self.inner = inner
        self.mode = "ok"
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        return self.inner.contains_prefix(keys)

    def contains(self, key: bytes) -> bool:
        return self.inner.contains(key)

    def get(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        return self.inner.get(keys, dests)

    def put(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10), "test never opened the gate"
        if self.mode == "raise":
            raise lmdb.Error("mdb_txn_commit: No space left on device")
        if self.mode == "refuse":
            return [False] * len(keys)
        return self.inner.put(keys, srcs)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.inner.delete(keys)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()

    def record_events(self, on: bool) -> None:
        super().record_events(on)
        self.inner.record_events(on)

    def stats(self):  # noqa: ANN201 - TierStats
        return self.inner.stats()


def faulty_backend(root: Path, slots: int = 16, durable_puts: bool = False,
                   disk_bytes: int = 16 << 20, write: WriteRule | None = None) -> tuple[DaemonBackend, FaultyDisk]:
    """A daemon backend (private-memory host tier of ``slots`` slots) over a :class:`FaultyDisk` in ``root``;
    ``write``: its write policy (``None``: ``policy.write``'s default, ``write_back``)."""
    host = HostTier(LAYOUT, slots * LAYOUT.bytes_per_block, pin_memory="never", auto_evict=True)
    inner = DiskTier(LAYOUT, str(root / "lmdb"), disk_bytes, sync="always" if durable_puts else "interval",
                     map_step=1 << 20)
    disk = FaultyDisk(inner)
    return DaemonBackend(LAYOUT, host, disk, HoldTable(60.0), durable_puts=durable_puts, write=write), disk
