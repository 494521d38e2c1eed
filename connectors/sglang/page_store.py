"""Where the SGLang backend keeps pages: kvstore's host + disk tiers in this process, or a ``kvstore serve`` daemon.

Both are a :class:`~kvstore.tiers.base.Tier` (whole blocks of
``layout.bytes_per_block`` bytes under 32-byte keys), which is exactly what
SGLang's HiCache L3 interface asks for: ``contains_prefix`` is its
``batch_exists``, ``get``/``put`` its batched page reads and writes.

- ``connector: embedded`` in the kvstore config: :class:`LocalTier`, a host-RAM
  tier in front of the configured disk tier (LMDB or file), run by
  :class:`~kvstore.daemon.backend.DaemonBackend`, the same code that runs them
  inside the daemon (host misses load from disk into host, puts land in host
  and are written behind to disk, corrupt disk values are dropped misses), just
  without sockets or shared memory.
- ``connector: sidecar``: :class:`~kvstore.daemon.tier.DaemonTier`, the
  daemon's shared-memory host tier in front of its disk tier; pages survive
  the SGLang process and are shared by every engine on the host.

kvstore's :class:`~kvstore.store.TieredStore` is not used here: it is kvstore's
GPU block pool and radix index, keyed by tokens, while SGLang keeps its own
device and host pools and hands over host pages with its own page hashes; a
GPU pool here would only be an idle staging copy.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.config.schema import KVStoreConfig
from kvstore.daemon.backend import DaemonBackend
from kvstore.daemon.holds import HoldTable
from kvstore.daemon.tier import DaemonTier
from kvstore.layout import KVLayout
from kvstore.tiers import build_tier
from kvstore.tiers.base import Buffer, Tier, TierStats, check_buffers
from kvstore.tiers.host.tier import HostTier

CONNECT_WAIT_S = 10.0
"""How long opening a sidecar store waits for the daemon to answer."""


class LocalTier(Tier):
    """kvstore's host tier in front of its disk tier, in this process (``connector: embedded``)."""

    name = "local"

    def __init__(self, backend: DaemonBackend) -> None:
        super().__init__(backend.layout)
        self.backend = backend
        self.bpb = backend.layout.bytes_per_block

    @classmethod
    def from_config(cls, cfg: KVStoreConfig, layout: KVLayout) -> LocalTier:
        """Open the host tier (``cfg.host``) and the disk tier ``cfg.tiers`` names (``lmdb`` or ``file``), if any.

        Raises :class:`~kvstore.errors.TierError` when the disk tier cannot be
        opened (another process holds its directory, a damaged file).
        """
        host = HostTier(layout, int(cfg.host.capacity), pin_memory=cfg.host.pin_memory, auto_evict=True,
                        prefault=cfg.host.prefault)
        try:
            sections = {"lmdb": cfg.disk, "file": cfg.file}
            names = [t for t in cfg.tiers if t in sections]
            disk = build_tier(names[0], sections[names[0]], layout) if names else None
        except BaseException:
            host.close()
            raise
        durable = disk is not None and disk.name == "lmdb" and cfg.disk.sync == "always"
        return cls(DaemonBackend(layout, host, disk, HoldTable(cfg.daemon.hold_timeout_s), durable_puts=durable))

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the host or disk tier holds. Changes nothing."""
        return self.backend.exists_prefix(keys)

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored. Changes nothing."""
        return self.contains_prefix([key]) == 1

    def get(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        """Copy found blocks into ``dests`` (disk hits are loaded into the host tier first; corrupt ones miss)."""
        check_buffers(keys, dests, self.bpb, "local")
        out: list[bool] = []
        for block, dest in zip(self.backend.read_inline(keys), dests):
            if block is not None:
                dest.numpy()[:] = memoryview(block)
            out.append(block is not None)
        hits = sum(out)
        self._stats.hits += hits
        self._stats.misses += len(out) - hits
        self._stats.bytes_read += hits * self.bpb
        return out

    def put(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        """Store blocks in the host tier (written behind to disk); ``result[i]``: ``keys[i]`` is stored now."""
        check_buffers(keys, srcs, self.bpb, "local")
        out = self.backend.put_inline(keys, [s.numpy().data for s in srcs])
        self._stats.puts += sum(out)
        self._stats.bytes_written += sum(out) * self.bpb
        return out

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove ``keys`` from both tiers; returns how many were removed from either."""
        return self.backend.delete(keys)

    def flush(self) -> None:
        """Write every stored block to disk and sync it; raises :class:`~kvstore.errors.NotDurable` if some did not make it."""
        self.backend.flush()

    def close(self) -> None:
        """Flush the write-behind queue and close both tiers (the disk data stays)."""
        self.backend.close()

    def stats(self) -> TierStats:
        """This adapter's hits, misses and bytes plus the tiers' corrupt drops and occupancy."""
        snap = super().stats()
        for tier in (self.backend.host, self.backend.disk):
            if tier is not None:
                t = tier.stats()
                snap.corrupt_dropped += t.corrupt_dropped
                snap.read_errors += t.read_errors
                snap.evictions += t.evictions
        return snap


def open_page_store(cfg: KVStoreConfig, client_name: str) -> Tier:
    """The page store ``cfg.connector`` names, for the layout ``cfg.model`` describes.

    ``sidecar`` connects to ``cfg.daemon.socket_path`` (waiting up to
    :data:`CONNECT_WAIT_S`) and raises
    :class:`~kvstore.daemon.client.DaemonUnavailable` if nothing answers, or
    :class:`~kvstore.daemon.frames.DaemonError` if the daemon refuses the
    handshake (wrong token, a different ``model`` section).
    """
    layout = cfg.model.layout()
    if cfg.connector == "embedded":
        return LocalTier.from_config(cfg, layout)
    return DaemonTier.from_config(cfg, client_name, CONNECT_WAIT_S, layout)
