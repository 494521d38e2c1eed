"""The embedded store's side of the remote write policy: its groups found by the radix index, its blocks held
and read from the GPU, host and disk tiers.

Which groups go remote, and when (``remote.write``), is decided by
:class:`~kvstore.lower.remote_write.RemoteWritePolicy`, which the daemon uses too. This module gives it what
only the store knows:

- a block's group, from the radix path (:meth:`RemoteWriter.on_commit`: the groups a commit completes;
  :meth:`RemoteWriter.on_hit`: the matched prefix; :meth:`RemoteWriter.hand_down` and
  :meth:`RemoteWriter.disk_victims` for ``write_back``: the group of a block about to lose its last local copy);
- how a group's blocks are held and read (:class:`RadixGroups`): a GPU reference or a host pin taken under the
  hierarchy lock, copied to private host buffers on the policy's thread and given back at once; a block only on
  disk read there. ``write_back`` copies GPU and host blocks at once (the victim is leaving), and disk victims
  through the evicting tier's reader, in its transaction.

::

    commit k9 (positions 8..9 new, G = 4)   chain k0 … k9
      group 2 = k8 k9 k10 k11  -> not full yet, waits for k11
    commit k10 k11                           group 2 is full: its 4 blocks are read from wherever
                                             they live now (GPU, host, disk) and stored as one value
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.config.write_policy import SELECTIVE_HITS_DEFAULT
from kvstore.store.hierarchy import Hierarchy
from kvstore.store.host_slot import HostSlot
from kvstore.lower.remote_write import (
    MAX_QUEUED_BYTES,
    Group,
    RemoteWrite,
    RemoteWritePolicy,
    completed_groups,
)
from kvstore.store.radix import BlockEntry, RadixIndex
from kvstore.tiers.base import BlockReader, Buffer, VictimSend
from kvstore.tiers.chain import ChainTier
from kvstore.store.transfer import copy_bytes, staging_buffer


@dataclass
class _Source:
    """Where one block of a group is read from (held until the group is copied)."""

    key: bytes
    gpu_block: int | None = None
    host: HostSlot | None = None
    data: torch.Tensor | None = None
    """A private copy made already (``write_back``). With none of the three: read from the disk tier."""


@dataclass
class HeldGroup:
    """A group's blocks as the store keeps them until the policy's thread copies them."""

    sources: list[_Source]
    bytes_per_block: int

    @property
    def private_bytes(self) -> int:
        """Bytes of the private copies made already."""
        return sum(1 for s in self.sources if s.data is not None) * self.bytes_per_block


class RadixGroups:
    """The store's :class:`~kvstore.lower.remote_write.GroupSource`: holds and reads a group's blocks in the
    hierarchy ``h`` (GPU, host, disk)."""

    def __init__(self, h: Hierarchy) -> None:
        self.h = h

    def hold(self, groups: Sequence[Group]) -> list[HeldGroup | None]:
        """Reference or pin each block's fastest copy (a disk copy is read later); ``None`` for a group one of
        whose blocks has none. Takes the hierarchy lock."""
        h = self.h
        with h.lock:
            return [self._hold(gr) for gr in groups]

    def _hold(self, group: Group) -> HeldGroup | None:
        h, pl = self.h, self.h.placement
        out: list[_Source] = []
        for key in group:
            e = h.index.get(key)
            if e is not None and e.gpu_block is not None:
                pl.ref([e.gpu_block])
                out.append(_Source(key, gpu_block=e.gpu_block))
                continue
            pin = pl.pin_host(key, use=False) if e is not None else None  # a copy to the remote tier, not a use
            if pin is not None:
                out.append(_Source(key, host=pin))
            elif e is not None and e.on_disk and h.disk is not None:
                out.append(_Source(key))
            else:
                self._release(out)
                return None
        return HeldGroup(out, h.layout.bytes_per_block)

    def copy_locked(self, groups: Sequence[Group]) -> list[HeldGroup | None]:
        """Private copies of each group's GPU and host blocks, its disk-only blocks left to :meth:`read`;
        ``None`` for a group one of whose blocks is in no local tier (call under the hierarchy lock)."""
        h = self.h
        out: list[HeldGroup | None] = []
        for gr in groups:
            held = HeldGroup([_Source(k, data=self._private_copy(k)) for k in gr], h.layout.bytes_per_block)
            on_disk = all(s.data is not None or ((e := h.index.get(s.key)) is not None and e.on_disk
                                                 and h.disk is not None) for s in held.sources)
            out.append(held if on_disk else None)
        return out

    def copy_victims(self, groups: Sequence[Group], read: BlockReader) -> list[HeldGroup | None]:
        """Private copies of each group: GPU and host blocks under the hierarchy lock, the others through
        ``read`` (the evicting disk tier's transaction) outside it; ``None`` for a group one of whose blocks
        neither has."""
        h = self.h
        with h.lock:
            helds = [HeldGroup([_Source(k, data=self._private_copy(k)) for k in gr], h.layout.bytes_per_block)
                     for gr in groups]
        out: list[HeldGroup | None] = []
        for held in helds:
            on_disk = [s for s in held.sources if s.data is None]
            bufs = [staging_buffer(h.layout, pin=False) for _ in on_disk]
            if not all(read([s.key for s in on_disk], bufs)):
                out.append(None)  # a block is in no local tier (or damaged on disk): the group is incomplete
                continue
            for s, buf in zip(on_disk, bufs):
                s.data = buf
            out.append(held)
        return out

    def read(self, group: Group, held: HeldGroup) -> list[Buffer] | None:
        """A private CPU copy of each block, the holds given back; ``None`` if a disk read fails."""
        h, pl = self.h, self.h.placement
        out: list[Buffer] = []
        try:
            for s in held.sources:
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
        finally:
            with h.lock:
                self._release(held.sources)

    def stored(self, group: Group, blocks: int) -> None:
        """Count the blocks in the hierarchy's counters and events."""
        h = self.h
        with h.lock:
            h.counters.spilled_blocks["remote"] += blocks
            for key in group:
                h.events.put("stored", key, "remote")

    def _private_copy(self, key: bytes) -> torch.Tensor | None:
        """A private CPU copy of ``key``'s GPU block or host slot; ``None`` when it has neither (under the lock)."""
        h = self.h
        entry = h.index.get(key)
        buf = staging_buffer(h.layout, pin=False)
        if entry is not None and entry.gpu_block is not None:
            return copy_bytes(buf, h.pool.block_bytes(entry.gpu_block))
        if h.host is not None and h.host.contains(key):
            slot = h.host.slot_of(key)
            if slot is not None:
                return copy_bytes(buf, h.host.slot_view(slot))
        return None

    def _release(self, srcs: list[_Source]) -> None:
        """Give back what :meth:`_hold` took (under the lock)."""
        pl = self.h.placement
        for s in srcs:
            if s.gpu_block is not None:
                pl.unref([s.gpu_block])
            elif s.host is not None:
                pl.release(s.host)


class RemoteWriter:
    """Feeds the store's commits, hits and evictions to its :attr:`policy` as groups (see the module docstring)."""

    def __init__(self, h: Hierarchy, remote: ChainTier, write: RemoteWrite = "write_through",
                 selective_hits: int = SELECTIVE_HITS_DEFAULT, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.h = h
        self.groups = RadixGroups(h)
        self.policy: RemoteWritePolicy[HeldGroup] = RemoteWritePolicy(remote, self.groups, write, selective_hits,
                                                                      max_queued_bytes)
        """The one owner of ``remote.write`` (the daemon's :class:`~kvstore.daemon.server.remote_link.RemoteLink` has one too)."""

    def on_commit(self, new: Sequence[BlockEntry]) -> None:
        """``new`` entries were committed: give the policy the groups they complete (call without the lock)."""
        if self.policy.write != "write_through" or not new:
            return
        with self.h.lock:
            chain = [e.key for e in RadixIndex.path_to(new[-1])]
        if len(chain) < len(new):
            return  # the entries left the index meanwhile
        self.policy.committed(completed_groups(chain, len(chain) - len(new), self.policy.g))

    def on_hit(self, keys: Sequence[bytes]) -> None:
        """A lookup matched the prefix ``keys`` (from the chain's first block) in local tiers (call without the
        lock)."""
        self.policy.hit(keys, len(keys))

    def hand_down(self, entry: BlockEntry) -> None:
        """``entry``'s last local copy (its GPU block or host slot) is about to go: under ``write_back``, copy its
        group (its GPU and host blocks now, disk-only ones on the policy's thread) and queue the send (call under
        the lock, before the copy goes). Copying now, rather than holding the sources, keeps the group's other
        blocks evictable."""
        if self.policy.write != "write_back":
            return
        group = self._group_of(entry)
        if group is not None:
            send = self.policy.victims([group], self.groups.copy_locked)
            if send is not None:
                send()

    def disk_victims(self, keys: Sequence[bytes], read: BlockReader) -> VictimSend | None:
        """The disk tier's victim hook under ``write_back`` (:meth:`Tier.set_victim_hook`): the disk is about to
        evict ``keys``; their indexed groups are copied (GPU and host blocks under the hierarchy lock, disk blocks
        through ``read``, in the tier's own transaction) and the send that queues them is returned. A victim the
        GPU or the host tier still holds goes too: those copies are transient (they leave without a disk write
        once the index records the disk copy), and sending now, once, is what keeps the group from being lost.

        Runs on the thread whose ``put`` evicts, under the disk tier's write lock: lock order is the disk tier's,
        then the hierarchy's, and nothing holding the hierarchy lock waits for the disk tier's. No network I/O
        here: the send only queues."""
        if self.policy.write != "write_back":
            return None
        with self.h.lock:
            groups = [gr for e in map(self.h.index.get, keys) if e is not None and (gr := self._group_of(e)) is not None]
        return self.policy.victims(groups, lambda due: self.groups.copy_victims(due, read))

    def _group_of(self, entry: BlockEntry) -> Group | None:
        """The full group ``entry`` belongs to, or ``None`` for a partial one or one whose end lies beyond a
        branch (neither goes remote) or an unindexed entry (under the lock). Changes nothing."""
        if entry.node is None:
            return None
        g = self.policy.g
        path = RadixIndex.path_to(entry)
        pos = len(path) - 1
        start = pos // g * g
        node_entries = entry.node.entries
        at = node_entries.index(entry)
        group = path[start:] + node_entries[at + 1: at + 1 + start + g - 1 - pos]  # the group's later blocks, if in this run
        return tuple(e.key for e in group) if len(group) == g else None

    def pending(self) -> bool:
        """Whether group sends are scheduled or running."""
        return self.policy.pending()

    def wait(self) -> None:
        """Block until every scheduled group send has finished."""
        self.policy.wait()

    def close(self) -> None:
        """Finish the scheduled sends and stop the thread."""
        self.policy.close()
