"""Write-through to the remote tier: each group of blocks goes remote once its last block is committed.

::

    commit k9 (positions 8..9 new, G = 4)   chain k0 … k9
      group 2 = k8 k9 k10 k11  -> not full yet, waits for k11
    commit k10 k11                           group 2 is full: its 4 blocks are read from wherever
                                             they live now (GPU, host, disk) and stored as one value

Sources are held (a GPU reference, a host pin) under the hierarchy lock, copied to private host
buffers on this writer's own thread and given back at once; only then are the groups sent (a slow or
dead server never delays the local write-downs or the engine, nor holds a GPU block). A group one of whose blocks has left every local tier is skipped (counted).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvstore.hierarchy import Hierarchy
from kvstore.placement import HostSlot
from kvstore.radix import BlockEntry, RadixIndex
from kvstore.tiers.chain import ChainTier
from kvstore.transfer import copy_bytes, staging_buffer

log = logging.getLogger("kvstore.remote_writer")


@dataclass
class _Source:
    """Where one block of a group is read from (held until the group is sent)."""

    key: bytes
    gpu_block: int | None = None
    host: HostSlot | None = None
    """Otherwise: read from the disk tier."""


class RemoteWriter:
    """Stores full groups of committed blocks in the hierarchy's remote tier (``remote.write: write_through``)."""

    def __init__(self, h: Hierarchy, remote: ChainTier, enabled: bool) -> None:
        self.h = h
        self.remote = remote
        self.enabled = enabled
        self.skipped_groups = 0
        """Groups not written because a block had left every local tier before the write."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-remote-write")
        self._pending: set[Future[None]] = set()

    def on_commit(self, new: Sequence[BlockEntry]) -> None:
        """Schedule the groups that the freshly committed ``new`` entries complete (call without the lock)."""
        if not self.enabled or not new:
            return
        g = self.remote.group_blocks
        h = self.h
        jobs: list[tuple[list[bytes], int, list[_Source]]] = []
        with h.lock:
            path = RadixIndex.path_to(new[-1])
            if not path:
                return
            first_new = len(path) - len(new)
            for gi in range(first_new // g, len(path) // g):
                end = gi * g + g
                if end - 1 < first_new:
                    continue  # this group was complete before the commit
                srcs = self._hold(path[gi * g: end])
                if srcs is None:
                    self.skipped_groups += 1
                    continue
                jobs.append(([e.key for e in path[:end]], gi * g, srcs))
        if jobs:
            fut = self._pool.submit(self._write, jobs)
            self._pending.add(fut)
            fut.add_done_callback(self._pending.discard)

    def _hold(self, entries: Sequence[BlockEntry]) -> list[_Source] | None:
        """Reference or pin each block's fastest copy (under the lock); ``None`` if one has no copy."""
        h, pl = self.h, self.h.placement
        out: list[_Source] = []
        for e in entries:
            if e.gpu_block is not None:
                pl.ref([e.gpu_block])
                out.append(_Source(e.key, gpu_block=e.gpu_block))
                continue
            pin = pl.pin_host(e.key)
            if pin is not None:
                out.append(_Source(e.key, host=pin))
            elif e.on_disk and h.disk is not None:
                out.append(_Source(e.key))
            else:
                self._release(out)
                return None
        return out

    def _write(self, jobs: list[tuple[list[bytes], int, list[_Source]]]) -> None:
        """Copy every group's blocks to private host buffers and give the sources back, then send.

        The GPU references and host pins last only as long as the copies, never a network round trip.
        """
        h = self.h
        copied: list[tuple[list[bytes], int, list[_Source], list[torch.Tensor]]] = []
        for chain, start, srcs in jobs:
            try:
                bufs = self._read(srcs)
            except Exception:  # noqa: BLE001 - a failed copy loses an optimisation, never an engine error
                log.exception("reading group ending %s for the remote tier failed", chain[-1].hex()[:16])
                bufs = None
            finally:
                with h.lock:
                    self._release(srcs)
            if bufs is None:
                self.skipped_groups += 1
            else:
                copied.append((chain, start, srcs, bufs))
        for chain, start, srcs, bufs in copied:
            try:
                stored = self.remote.store(chain, start, bufs)
            except Exception:  # noqa: BLE001 - as above
                log.exception("writing group ending %s to the remote tier failed", chain[-1].hex()[:16])
                stored = 0
            if stored:
                with h.lock:
                    h.counters.spilled_blocks["remote"] += stored
                    for s in srcs:
                        h.events.put("stored", s.key, "remote")

    def _read(self, srcs: list[_Source]) -> list[torch.Tensor] | None:
        """A private CPU copy of each block (outside the lock); ``None`` if a disk read fails."""
        h, pl = self.h, self.h.placement
        out: list[torch.Tensor] = []
        for s in srcs:
            buf = staging_buffer(h.layout, pin=False)
            if s.gpu_block is not None:
                copy_bytes(buf, h.pool.block_bytes(s.gpu_block))
            elif s.host is not None:
                copy_bytes(buf, pl.view(s.host))
            else:
                assert h.disk is not None
                if not h.disk.get([s.key], [buf])[0]:
                    return None
            out.append(buf)
        return out

    def _release(self, srcs: list[_Source]) -> None:
        """Give back what :meth:`_hold` took (under the lock)."""
        pl = self.h.placement
        for s in srcs:
            if s.gpu_block is not None:
                pl.unref([s.gpu_block])
            elif s.host is not None:
                pl.release(s.host)

    def pending(self) -> bool:
        """Whether group writes are scheduled or running."""
        return bool(self._pending)

    def wait(self) -> None:
        """Block until every scheduled group write has finished."""
        for fut in list(self._pending):
            fut.result()

    def close(self) -> None:
        """Finish the scheduled writes and stop the thread."""
        self.wait()
        self._pool.shutdown(wait=True)
