"""The host tier in front of the disk tier (and the remote tier), in one process: the daemon's stack without
its sockets, for an engine adapter's ``connector: embedded``.

:class:`LocalTier` is one :class:`~kvstore.tiers.base.Tier` (whole blocks of ``layout.bytes_per_block``
bytes under 32-byte keys) run by :class:`~kvstore.daemon.server.backend.DaemonBackend`, the code that runs the
same tiers inside the daemon: host misses load from disk into host, puts land in host and go to disk as
``policy.write`` says (under ``write_back`` when host room runs low, at ``flush`` and ``close``), a put the host tier has no room for (every slot waiting for its disk write) is written
through to disk instead of refused, corrupt disk values are dropped misses, and a remote tier is fed and
read by chain position (``remote.write``). Its tiers are built by :func:`kvstore.lower.build.build_lower_tiers`
with the placement policy's orders, like the daemon's.

The engine adapters use it: vLLM's (:class:`connectors.engine_store.EngineBlockStore`) and SGLang's
HiCache storage backend (``contains_prefix`` is its ``batch_exists``, ``get``/``put`` its batched page
reads and writes). kvstore's :class:`~kvstore.store.tiered.TieredStore` is not used there: it is kvstore's GPU
block pool and radix index, keyed by tokens, while those engines keep their own device and host pools and
hand over pages with their own hashes; a GPU pool there would only be an idle staging copy.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.config.schema import KVStoreConfig
from kvstore.daemon.server.backend import DaemonBackend
from kvstore.daemon.server.holds import HoldTable
from kvstore.daemon.server.remote_link import link_for
from kvstore.layout import KVLayout
from kvstore.lower.build import HostPlan, build_lower_tiers
from kvstore.lower.write_policy import WriteRule
from kvstore.tiers.base import Buffer, Tier, TierStats, check_buffers


class LocalTier(Tier):
    """kvstore's host tier in front of its disk tier, in this process (``connector: embedded``)."""

    name = "local"

    def __init__(self, backend: DaemonBackend) -> None:
        super().__init__(backend.layout)
        self.backend = backend
        self.bpb = backend.layout.bytes_per_block

    @classmethod
    def from_config(cls, cfg: KVStoreConfig, layout: KVLayout) -> LocalTier:
        """Open the host tier (``cfg.host``, whether or not ``tiers`` names it: it is the stack's front), the
        disk tier ``cfg.tiers`` names, if any, and the remote tier when named.

        Raises :class:`~kvstore.errors.TierError` when the disk tier cannot be
        opened (another process holds its directory, a damaged file).
        """
        tiers = build_lower_tiers(cfg, layout, HostPlan(auto_evict=True, always=True, shared_memory=False))
        assert tiers.host is not None  # always
        disk = tiers.disk
        durable = disk is not None and ((disk.name == "lmdb" and cfg.disk.sync == "always")
                                        or (disk.name == "slab" and cfg.slab.sync == "always"))
        backend = DaemonBackend(layout, tiers.host, disk, HoldTable(cfg.daemon.hold_timeout_s), durable_puts=durable,
                                write=WriteRule.from_config(cfg.policy))
        try:
            backend.link = link_for(backend, tiers.remote, cfg)
        except BaseException:
            if tiers.remote is not None:
                tiers.remote.close()
            backend.close()
            raise
        return cls(backend)

    @property
    def probes_by_chain(self) -> bool:  # type: ignore[override]
        """With a remote tier, lookups go by chain position (its groups): :meth:`probe`."""
        return self.backend.link is not None

    def probe(self, chain: Sequence[bytes], start: int = 0) -> int:
        """How many blocks of ``chain`` (keys from position 0), from position 0, the host, disk or remote tier
        holds, given the caller holds the first ``start``; remote groups found start loading into host."""
        return self.backend.exists_chain(chain, start)

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
        """Write dirty blocks down, flush the write-behind queue and close both tiers (the disk data stays)."""
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
