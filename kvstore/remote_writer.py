"""Writes to the remote tier under its write policy (``remote.write``), one full group at a time.

``write_through``: a group goes remote once its last block is committed (below).
``write_through_selective``: once a lookup has matched its last block ``remote.selective_hits`` times
(the first block of a prefix is matched at least as often as its last, so the last decides).
``write_back``: when one of its blocks is about to lose its last local copy: leaving the GPU or the host
tier with no tier below (:meth:`RemoteWriter.hand_down`), or evicted by the disk tier
(:meth:`RemoteWriter.disk_victims`, the disk tier's victim hook, which reads the group's disk blocks in
the evicting transaction); the group's blocks are copied to private buffers at once (``group_blocks``
block copies, once per group), and sent on the writer's thread.
A group is sent once per writer (:data:`SENT_MEMORY` last keys remembered), so repeated hits or the
eviction of its other blocks do not send it again.
The ``write_back`` copies waiting for a send are bounded (:attr:`RemoteWriter.max_queued_bytes`): past
it a group is shed (``shed_groups``) and not remembered, so neither a slow server nor a fast disk makes
the evicting thread wait or the queue grow.

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
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from kvstore.config.write_policy import SELECTIVE_HITS_DEFAULT, WritePolicy
from kvstore.hierarchy import Hierarchy
from kvstore.host_slot import HostSlot
from kvstore.radix import BlockEntry, RadixIndex
from kvstore.tiers.base import BlockReader, VictimSend
from kvstore.tiers.chain import ChainTier
from kvstore.transfer import copy_bytes, staging_buffer

log = logging.getLogger("kvstore.remote_writer")

RemoteWrite = WritePolicy | Literal["read_only"]
"""The remote tier's write policies (``remote.write``)."""

SENT_MEMORY = 1 << 16
"""Last keys of the groups a writer remembers having sent (least recently sent forgotten first); the daemon's
remote link (:mod:`kvstore.daemon.remote_link`) keeps as many, for groups sent or whose hits it counted."""

MAX_QUEUED_BYTES = 256 << 20
"""Default bound on the bytes of ``write_back`` copies waiting for (or in) a send; a group beyond it is shed
(a store built from config uses ``remote.max_inflight_bytes``)."""


@dataclass(frozen=True)
class _Group:
    """One full group of indexed blocks (see :meth:`RemoteWriter._group_of`)."""

    chain: list[bytes]
    """Keys of the chain from position 0 to the group's last block."""
    start: int
    """Position of the group's first block."""
    entries: list[BlockEntry]
    """The group's ``G`` blocks."""

    @property
    def last(self) -> bytes:
        """The key the group is stored under (its last block's)."""
        return self.chain[-1]


@dataclass
class _Source:
    """Where one block of a group is read from (held until the group is sent)."""

    key: bytes
    gpu_block: int | None = None
    host: HostSlot | None = None
    data: torch.Tensor | None = None
    """A private copy made already (a ``write_back`` victim). With none of the three: read from the disk tier."""


class RemoteWriter:
    """Stores full groups of indexed blocks in the hierarchy's remote tier under ``policy`` (see the module docstring)."""

    def __init__(self, h: Hierarchy, remote: ChainTier, policy: RemoteWrite = "write_through",
                 selective_hits: int = SELECTIVE_HITS_DEFAULT, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.h = h
        self.remote = remote
        self.policy: RemoteWrite = policy
        self.selective_hits = selective_hits
        self.max_queued_bytes = max_queued_bytes
        """Most bytes of private copies (``write_back``) queued or being sent at once: a slow server makes
        further groups shed (counted), never the tier that evicts wait or memory grow."""
        self.skipped_groups = 0
        """Groups not written because a block had left every local tier before the write."""
        self.shed_groups = 0
        """``write_back`` groups dropped unsent because :attr:`max_queued_bytes` of copies were waiting already."""
        self._queued = 0  # bytes of private copies in scheduled jobs (under h.lock)
        self._sent: OrderedDict[bytes, None] = OrderedDict()  # last keys of groups scheduled (under h.lock)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-remote-write")
        self._pending: set[Future[None]] = set()

    @property
    def counts_hits(self) -> bool:
        """Whether lookups must count hits on matched blocks for this writer (``write_through_selective``)."""
        return self.policy == "write_through_selective"

    def on_commit(self, new: Sequence[BlockEntry]) -> None:
        """Under ``write_through``: schedule the groups the freshly committed ``new`` entries complete
        (call without the lock). Other policies: nothing."""
        if self.policy != "write_through" or not new:
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
                self._schedule(path[:end], gi * g, jobs)
        self._submit(jobs)

    def on_hit(self, matched: Sequence[BlockEntry]) -> None:
        """Under ``write_through_selective``: schedule the full groups of the matched prefix ``matched``
        (from the chain's first block) whose last block has now been matched ``selective_hits`` times and
        that were not sent yet (call without the lock). Other policies: nothing."""
        if self.policy != "write_through_selective" or not matched:
            return
        g = self.remote.group_blocks
        jobs: list[tuple[list[bytes], int, list[_Source]]] = []
        with self.h.lock:
            for gi in range(len(matched) // g):
                end = gi * g + g
                last = matched[end - 1]
                if last.node is not None and last.hits >= self.selective_hits and last.key not in self._sent:
                    self._schedule(list(matched[:end]), gi * g, jobs)
        self._submit(jobs)

    def hand_down(self, entry: BlockEntry) -> None:
        """Under ``write_back``: ``entry``'s last local copy (its GPU block or host slot) is about to go;
        copy its full group's GPU and host blocks to private buffers now and schedule the send (blocks only
        on disk are read on the writer's thread), unless that group was sent already or one of its blocks
        has no local copy (call under the lock, before the copy goes). Copying now, rather than holding the
        sources, keeps the group's other blocks evictable. Other policies: nothing."""
        if self.policy != "write_back":
            return
        group = self._group_of(entry)
        if group is None or group.last in self._sent:
            return
        srcs = self._copy_group(group.entries)
        if not all(s.data is not None or (e.on_disk and self.h.disk is not None) for s, e in zip(srcs, group.entries)):
            self.skipped_groups += 1  # a block left every local tier: the group is incomplete
            return
        if self._admit(srcs):
            self._remember(group.last)
            self._submit([(group.chain, group.start, srcs)])

    def disk_victims(self, keys: Sequence[bytes], read: BlockReader) -> VictimSend | None:
        """The disk tier's victim hook under ``write_back`` (:meth:`Tier.set_victim_hook`): the disk is about
        to evict ``keys``, its last local tier's copies; for each indexed one, copy its full group to private
        buffers (GPU and host blocks under the hierarchy lock, disk blocks through ``read``, in the tier's own
        transaction, outside that lock) and return the send that schedules them. A group sent already is not
        copied again; one whose block has no local copy is skipped (counted). A victim the GPU or the host
        tier still holds goes too: those copies are transient (they leave without a disk write once the
        index records the disk copy, and the spiller may publish a disk copy that this eviction just took),
        and sending now, once, is what keeps the group from being lost.

        Runs on the thread whose ``put`` evicts (the spill writer's, or an engine thread making GPU room),
        under the disk tier's write lock: lock order is the disk tier's, then the hierarchy's, and nothing
        holding the hierarchy lock waits for the disk tier's. No network I/O here: the send only queues."""
        h = self.h
        groups: list[tuple[_Group, list[_Source]]] = []
        with h.lock:
            seen: set[bytes] = set()
            for key in keys:
                entry = h.index.get(key)
                if entry is None:
                    continue  # unindexed: no chain to group it by
                group = self._group_of(entry)
                if group is None or group.last in self._sent or group.last in seen:
                    continue
                seen.add(group.last)
                groups.append((group, self._copy_group(group.entries)))
        jobs: list[tuple[list[bytes], int, list[_Source]]] = []
        for group, srcs in groups:
            on_disk = [s for s in srcs if s.data is None]
            bufs = [staging_buffer(h.layout, pin=False) for _ in on_disk]
            if not all(read([s.key for s in on_disk], bufs)):
                self.skipped_groups += 1  # a block is in no local tier (or damaged on disk): the group is incomplete
                continue
            for s, buf in zip(on_disk, bufs):
                s.data = buf
            jobs.append((group.chain, group.start, srcs))
        return (lambda: self._submit_copies(jobs)) if jobs else None

    def _submit_copies(self, jobs: list[tuple[list[bytes], int, list[_Source]]]) -> None:
        """The send of :meth:`disk_victims` (the victims are gone): schedule the copied groups, except those
        sent meanwhile."""
        with self.h.lock:
            jobs = [j for j in jobs if j[0][-1] not in self._sent and self._admit(j[2])]
            for chain, _, _ in jobs:
                self._remember(chain[-1])
        self._submit(jobs)

    def _admit(self, srcs: list[_Source]) -> bool:
        """Count the private copies of ``srcs`` as queued, or shed the group if that would pass
        :attr:`max_queued_bytes` (under the lock; :meth:`_write` gives the bytes back once sent)."""
        nbytes = self._private_bytes(srcs)
        if self._queued + nbytes > self.max_queued_bytes:
            self.shed_groups += 1
            return False
        self._queued += nbytes
        return True

    def _private_bytes(self, srcs: list[_Source]) -> int:
        return sum(1 for s in srcs if s.data is not None) * self.h.layout.bytes_per_block

    def _group_of(self, entry: BlockEntry) -> _Group | None:
        """The full group ``entry`` belongs to, or ``None`` for a partial one or one whose end lies beyond a
        branch (neither goes remote) or an unindexed entry (under the lock). Changes nothing."""
        if entry.node is None:
            return None
        g = self.remote.group_blocks
        path = RadixIndex.path_to(entry)
        pos = len(path) - 1
        start = pos // g * g
        node_entries = entry.node.entries
        at = node_entries.index(entry)
        group = path[start:] + node_entries[at + 1: at + 1 + start + g - 1 - pos]  # the group's later blocks, if in this run
        if len(group) < g:
            return None
        return _Group([e.key for e in path[:start]] + [e.key for e in group], start, group)

    def _copy_group(self, group: Sequence[BlockEntry]) -> list[_Source]:
        """A source per block of ``group``: a private copy of its GPU block or host slot, else (no data) one to
        read from the disk tier, if it has it (under the lock)."""
        return [_Source(e.key, data=self._private_copy(e)) for e in group]

    def _private_copy(self, entry: BlockEntry) -> torch.Tensor | None:
        """A private CPU copy of ``entry``'s GPU block or host slot; ``None`` when it has neither (under the lock)."""
        h = self.h
        buf = staging_buffer(h.layout, pin=False)
        if entry.gpu_block is not None:
            return copy_bytes(buf, h.pool.block_bytes(entry.gpu_block))
        if h.host is not None and h.host.contains(entry.key):
            slot = h.host.slot_of(entry.key)
            if slot is not None:
                return copy_bytes(buf, h.host.slot_view(slot))
        return None

    def _schedule(self, path: list[BlockEntry], start: int, jobs: list[tuple[list[bytes], int, list[_Source]]]) -> None:
        """Hold the group ``path[start:]`` (under the lock) and add its job, or count it skipped."""
        srcs = self._hold(path[start:])
        if srcs is None:
            self.skipped_groups += 1
            return
        self._remember(path[-1].key)
        jobs.append(([e.key for e in path], start, srcs))

    def _remember(self, last_key: bytes) -> None:
        self._sent[last_key] = None
        self._sent.move_to_end(last_key)
        if len(self._sent) > SENT_MEMORY:
            self._sent.popitem(last=False)

    def _submit(self, jobs: list[tuple[list[bytes], int, list[_Source]]]) -> None:
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
            pin = pl.pin_host(e.key, use=False)  # a copy to the remote tier, not a use
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
        try:
            self._read_and_send(jobs)
        finally:
            with self.h.lock:
                self._queued -= sum(self._private_bytes(srcs) for _, _, srcs in jobs)

    def _read_and_send(self, jobs: list[tuple[list[bytes], int, list[_Source]]]) -> None:
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
            if s.data is not None:
                out.append(s.data)
                continue
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
