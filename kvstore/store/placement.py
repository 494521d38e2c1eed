"""The one owner of where a block lives: every residency change of the tiered store goes through here.

One file past 500 lines, on purpose: it is the one owner of where a block lives, so every write of a
block's residency is here and nowhere else; split, that fact would have two owners.

Where a block lives is recorded in its :class:`~kvstore.store.radix.BlockEntry`
(``gpu_block``, ``host_slot``, ``on_disk``); the blocks of a deferred run
(:class:`~kvstore.store.radix.RadixNode`), whose entries are not made yet, all live
on the GPU only, and the block map records their node until the entries are
made (:meth:`Placement._entries_made`). Only :class:`Placement` writes
those fields, takes or drops a reference on a GPU block, pins a radix node,
or reserves, pins, publishes and aborts host slots; the store, the spiller
and the prefetcher call it. Each transition checks the state it expects
(``entry.gpu_block is None`` before a block is recorded, a host handle is
released once) and raises :class:`PlacementError` otherwise, as vLLM's block
pool asserts a block's previous state.

Every method must be called with the hierarchy's lock held; none does I/O
(tier calls here are slot bookkeeping in memory, never a disk or socket).

The GPU eviction queue (:class:`~kvstore.policy.gpu_lru.GpuLru`) is kept here: a
GPU block is evictable when the index records it, nobody else holds a
reference (``ref_count == 1``) and its radix node is not pinned by a request,
and each of those three facts changes only in a method below, which updates
the queue. Host slots are handed out as :class:`~kvstore.store.host_slot.HostSlot`
handles.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol

import torch

from kvstore.errors import BlockStateError, PlacementError, short_key
from kvstore.policy.gpu_lru import GpuLru
from kvstore.hashing import Salt
from kvstore.store.host_slot import HostSlot
from kvstore.store.radix import BlockEntry, InsertResult, RadixNode

if TYPE_CHECKING:
    from kvstore.events import EventQueue
    from kvstore.store.gpu_pool import GPUBlockPool
    from kvstore.policy.use_memory import UseMemory
    from kvstore.store.radix import RadixIndex
    from kvstore.tiers.base import Tier
    from kvstore.tiers.host.tier import HostTier

_GPU_BLOCK = attrgetter("gpu_block")
LEFT_DISK_MEMORY = 65536
"""Most keys :class:`Placement` remembers as lost by the disk before their publish (oldest forgotten first)."""


class _DropCounter(Protocol):
    dropped_blocks: int


class Shared(Protocol):
    """What :class:`Placement` reads of the :class:`~kvstore.store.hierarchy.Hierarchy` it serves, read there on every use
    (``hand_down`` is set after the placement is built). Declared here so that placement does not import hierarchy,
    which builds the placement."""

    index: RadixIndex
    pool: GPUBlockPool
    host: HostTier | None
    disk: Tier | None
    events: EventQueue
    carry_uses: bool
    use_memory: UseMemory | None
    hand_down: Callable[[BlockEntry], None] | None

    @property
    def counters(self) -> _DropCounter: ...


class Placement:
    """Changes where blocks live, for one :class:`~kvstore.store.hierarchy.Hierarchy` (call with its lock held)."""

    def __init__(self, h: Shared) -> None:
        self.h = h
        self.gpu_lru = GpuLru()
        self._by_block: list[BlockEntry | RadixNode | None] = [None] * h.pool.num_blocks
        """GPU block id -> the entry the index records in it, or the node of a deferred run holding it (until the
        run's entries are made: :meth:`_entries_made`). A list, not a dict: a commit records every block
        of a prompt (8192 at 128k tokens) and list stores cost about a third of dict inserts."""
        h.index.on_entries_made = self._entries_made
        self._num_by_block = 0
        """Blocks recorded in :attr:`_by_block`."""
        self._homeless: dict[bytes, BlockEntry] = {}  # entries with no copy left, removed once unpinned
        self._left_disk: OrderedDict[bytes, None] = OrderedDict()
        """Indexed keys the disk reported losing while the index did not record them there: a put of theirs
        whose publish is still to come (:meth:`mark_on_disk`) may have stored the very copy that went."""

    # ----------------------------------------------------------- GPU blocks
    def index_gpu(self, entry: BlockEntry, block: int) -> None:
        """Record that ``entry`` lives in GPU ``block``; the index takes its own reference on it."""
        if entry.gpu_block is not None:
            raise PlacementError(f"block {short_key(entry.key)} already in GPU block {entry.gpu_block}")
        self.h.pool.incref([block])  # checks the id first
        if self._by_block[block] is not None:
            self.h.pool.free([block])
            owner = self.entry_of(block)
            raise PlacementError(f"GPU block {block} already records {short_key(owner.key) if owner else '?'}")
        entry.gpu_block = block
        self._by_block[block] = entry
        self._num_by_block += 1
        self._requeue(entry)

    def insert(
        self,
        keys: Sequence[bytes],
        gpu: Sequence[int | None],
        host: Sequence[int | None] | None = None,
        disk: Sequence[bool] | None = None,
        tokens: Sequence[int] | None = None,
        salt: Salt = None,
    ) -> InsertResult:
        """Index a key chain with where each block is now; blocks already indexed gain the copies they lack.

        The index takes its own reference on every GPU block it records; a
        GPU block offered for a block that already has a GPU copy is not
        recorded (the caller keeps and frees its duplicate).
        """
        gpu = list(gpu)
        hosts = list(host) if host is not None else None
        disks = list(disk) if disk is not None else None
        res = self.h.index.insert(keys, gpu_blocks=gpu, host_slots=hosts, on_disk=disks, tokens=tokens, salt=salt)
        k = res.num_existing
        if res.leaf is not None:
            try:
                self._register_new_gpu(res.leaf, gpu[k:] if k else gpu)
            except PlacementError:  # the new blocks are one new leaf: take it out again, the failed insert indexes nothing
                self.h.index.remove_leaf(res.leaf)
                raise
        memory = self.h.use_memory
        if memory is not None and len(memory):  # a block indexed again resumes the count it was dropped with
            for e in res.new_entries:
                e.hits += memory.recall(e.key)
        for i, e in enumerate(res.existing):
            g = gpu[i]
            if g is not None and e.gpu_block is None:
                self.index_gpu(e, g)
            if hosts is not None and hosts[i] is not None and e.host_slot is None:
                e.host_slot = hosts[i]
            if disks is not None and disks[i]:
                e.on_disk = True
        return res

    def _register_new_gpu(self, leaf: RadixNode, gpu: list[int | None]) -> None:
        """Take the index's reference on the GPU blocks of a leaf just created with them (``gpu[i]`` is its
        ``i``-th block's, the list it was made from: no pass over the entries to read it back). A deferred
        leaf is recorded itself, for every block (see :meth:`_entries_made`).

        None of them becomes evictable: the caller still holds its own reference (``incref``
        requires one), so each count is at least 2 and :meth:`_requeue` would change nothing.
        Changes nothing on error: a block recorded already, or offered twice, ends the recording pass,
        which is then undone (the caller takes the new entries out of the index).
        """
        new: Iterable[BlockEntry | RadixNode]
        blocks: list[int]
        if leaf.is_deferred:  # made with a GPU block each
            new, blocks = repeat(leaf), gpu  # type: ignore[assignment]  # no None: the index defers only those
        elif None in gpu:
            pairs = [(e, b) for e, b in zip(leaf.entries, gpu) if b is not None]
            new, blocks = [e for e, _ in pairs], [b for _, b in pairs]
        else:
            new, blocks = leaf.entries, gpu  # type: ignore[assignment]  # no None, checked just above
        if not blocks:
            return
        pool, bb = self.h.pool, self._by_block
        pool.incref(blocks)  # checks the ids first
        owner: BlockEntry | RadixNode | None = None
        done = 0
        for b, e in zip(blocks, new):  # one pass: a block recorded already, or offered twice, stops it
            owner = bb[b]
            if owner is not None:
                break
            bb[b] = e
            done += 1
        if owner is not None:  # undo: clear what this pass recorded, drop the references taken
            for b2 in blocks[:done]:
                bb[b2] = None
            pool.free(blocks)
            if owner is leaf or (isinstance(owner, BlockEntry) and owner.node is leaf):
                raise PlacementError(f"GPU block {b} already records another block of this commit (offered twice)")
            if isinstance(owner, RadixNode):
                owner.entries  # noqa: B018  # makes them: _entries_made records them in place of the node
                owner = bb[b]
            assert isinstance(owner, BlockEntry)
            raise PlacementError(f"GPU block {b} already records {short_key(owner.key)}")
        self._num_by_block += len(blocks)

    def _entries_made(self, entries: list[BlockEntry], gpu: list[int]) -> None:
        """A deferred run's entries were just made by the index (``entries[i]`` in GPU block ``gpu[i]``): record
        each in place of its node in the block map.

        Every block of a deferred run still records its node here (a change to one of them makes the entries
        first: :meth:`check` verifies the maps), so these are stores in C, no per-block test in Python."""
        deque(map(self._by_block.__setitem__, gpu, entries), maxlen=0)

    def unindex_gpu(self, entry: BlockEntry) -> None:
        """Forget ``entry``'s GPU copy and drop the index's reference on its block."""
        b = entry.gpu_block
        if b is None or self._by_block[b] is not entry:
            raise PlacementError(f"block {short_key(entry.key)} has no GPU copy recorded")
        self.gpu_lru.discard(b)
        self._by_block[b] = None
        self._num_by_block -= 1
        entry.gpu_block = None
        self.h.pool.free([b])

    def ref(self, blocks: Sequence[int]) -> None:
        """Add a reference per block for a holder other than the index (a lease, a copy in flight)."""
        self.h.pool.incref(blocks)
        for b in blocks:
            self.gpu_lru.discard(b)

    def unref(self, blocks: Sequence[int]) -> None:
        """Drop a holder's reference per block; cached blocks nobody else holds become evictable.

        A prefix's blocks are queued last first, so its tail is evicted before its head.
        """
        self.h.pool.free(blocks)
        by_block, pool, lru = self._by_block, self.h.pool, self.gpu_lru
        for b in reversed(blocks):
            entry = by_block[b]  # the ids were checked by the pool's free
            if entry is None:
                continue
            if isinstance(entry, RadixNode):  # a deferred run: every block on the GPU, the node in the index
                if entry.pin_count == 0 and pool.ref_count(b) == 1:
                    if b not in lru:
                        lru.push(b)
                else:
                    lru.discard(b)
            else:
                self._requeue(entry)

    def touch(self, entries: Sequence[BlockEntry]) -> None:
        """Make matched blocks most recently used, the first most recent (a prefix's tail goes first)."""
        self.gpu_lru.touch_all(map(_GPU_BLOCK, reversed(entries)))

    @property
    def num_gpu_cached(self) -> int:
        """GPU blocks the index records. Changes nothing."""
        return self._num_by_block

    def oldest_gpu(self) -> BlockEntry | None:
        """The entry of the least recently used evictable GPU block (``None``: none queued). Makes a deferred
        run's entries when the block is one of theirs; changes nothing else."""
        b = self.gpu_lru.oldest()
        return None if b is None else self.entry_of(b)

    def entry_of(self, block: int) -> BlockEntry | None:
        """The indexed entry GPU ``block`` holds, if any. Changes nothing."""
        if not 0 <= block < len(self._by_block):
            return None
        v = self._by_block[block]
        if isinstance(v, RadixNode):
            v.entries  # noqa: B018  # makes them: _entries_made records them in place of the node
            v = self._by_block[block]
        assert not isinstance(v, RadixNode)
        return v

    def evictable(self, entry: BlockEntry) -> bool:
        """Whether ``entry``'s GPU block belongs in the eviction queue: indexed, only the index holds a
        reference and its node is not pinned. Changes nothing."""
        b = entry.gpu_block
        return b is not None and entry.node is not None and entry.node.pin_count == 0 and self.h.pool.ref_count(b) == 1

    def _requeue(self, entry: BlockEntry) -> None:
        b = entry.gpu_block
        if b is None:
            return
        if self.evictable(entry):
            if b not in self.gpu_lru:
                self.gpu_lru.push(b)
        else:
            self.gpu_lru.discard(b)

    # ------------------------------------------------------------ radix pins
    def pin(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction for a request."""
        self.h.index.pin(node)
        n: RadixNode | None = node
        while n is not None:
            if n.pin_count == 1:
                for e in n.entries:
                    if e.gpu_block is not None:
                        self.gpu_lru.discard(e.gpu_block)
            n = n.parent

    def unpin(self, node: RadixNode) -> None:
        """Undo one :meth:`pin`; blocks nobody holds any more become evictable (deepest first)."""
        self.h.index.unpin(node)
        n: RadixNode | None = node
        while n is not None:
            if n.pin_count == 0:
                for e in reversed(n.entries):
                    self._requeue(e)
            n = n.parent
        self.reap()

    # ------------------------------------------------------------ host slots
    def reserve_host(self, key: bytes) -> HostSlot | None:
        """Reserve an invisible host slot to write ``key`` into; ``None`` when no slot is free.

        Makes room only by dropping host blocks that are already on disk (no
        I/O); the spiller makes more room outside the lock. Raises
        :class:`BlockStateError` when the host tier has ``key`` or another
        write has reserved it.
        """
        host = self.h.host
        assert host is not None
        slot = host.reserve([key])[0]
        if slot is None:
            for victim in host.victims(1):
                entry = self.h.index.get(victim)
                if self.h.disk is None or (entry is not None and entry.on_disk):
                    self.evict_host(victim)
                    slot = host.reserve([key])[0]
        return None if slot is None else HostSlot(key, slot, "reserved")

    def pin_host(self, key: bytes, use: bool = True) -> HostSlot | None:
        """Pin the published host copy of ``key`` for reading; ``None`` if the host tier has none. ``use``: the read
        serves a request (a use the host's order counts); ``False`` for the store's own copies down."""
        host = self.h.host
        if host is None or not host.contains(key):
            return None
        slot = host.pin([key], use=use)[0]
        assert slot is not None
        return HostSlot(key, slot, "pinned")

    def adopt_host_copy(self, entry: BlockEntry) -> None:
        """Record a host copy of ``entry`` that was published before the entry was indexed (in memory, no I/O)."""
        host = self.h.host
        if host is not None and entry.host_slot is None:
            entry.host_slot = host.slot_of(entry.key)

    def view(self, handle: HostSlot) -> torch.Tensor:
        """Zero-copy view of a live handle's slot."""
        if handle.state == "released":
            raise PlacementError(f"{handle!r}: view of a released host slot")
        assert self.h.host is not None
        return self.h.host.slot_view(handle.slot)

    def publish(self, handle: HostSlot) -> None:
        """Make a written reservation visible; the handle keeps it pinned. Records it in the index."""
        if handle.state != "reserved":
            raise PlacementError(f"{handle!r}: publish of a host slot that is not reserved")
        host = self.h.host
        assert host is not None
        host.pin([handle.key], use=False)
        host.publish([handle.key])
        handle.state = "pinned"
        entry = self.h.index.get(handle.key)
        if entry is not None and entry.host_slot is None:
            entry.host_slot = handle.slot
        uses = self.uses_of(handle.key)
        if uses is not None:
            host.seed_uses([handle.key], [uses])

    def uses_of(self, key: bytes) -> int | None:
        """Uses of indexed ``key`` so far (its insert plus the lookups that matched it) to seed a lower tier's
        order with, or ``None`` when counts are not carried (a placement policy's ``carry_uses``) or ``key`` is not indexed."""
        entry = self.h.index.get(key) if self.h.carry_uses else None
        return None if entry is None else entry.hits + 1

    def abort(self, handle: HostSlot) -> None:
        """Give back a reservation whose write failed or was cancelled."""
        if handle.state != "reserved":
            raise PlacementError(f"{handle!r}: abort of a host slot that is not reserved")
        assert self.h.host is not None
        self.h.host.abort([handle.key])
        handle.state = "released"

    def release(self, handle: HostSlot) -> None:
        """Unpin a published slot (the copy stays, evictable)."""
        if handle.state != "pinned":
            raise PlacementError(f"{handle!r}: release of a host slot that is not pinned (released twice?)")
        assert self.h.host is not None
        self.h.host.unpin([handle.key])
        handle.state = "released"

    def evict_host(self, key: bytes) -> bool:
        """Delete the unpinned host copy of ``key`` and clear the index's record; ``False`` if it is pinned."""
        host = self.h.host
        assert host is not None
        entry = self.h.index.get(key)
        if (self.h.hand_down is not None and entry is not None and entry.gpu_block is None and not entry.on_disk
                and host.contains(key)):
            self.h.hand_down(entry)  # its last local copy goes: the remote tier's write_back copies it first
        try:
            host.delete([key])
        except BlockStateError:
            return False  # a reader or a copy in flight holds it: it stays
        self.h.events.put("evicted", key, "host")
        self.lost(key, "host")
        return True

    def leave_host(self, key: bytes) -> None:
        """The GPU now holds ``key`` (exclusive tiers): drop its host copy, so host holds no block the GPU or the
        disk holds.

        The host copy goes at once unless a reader pins it (then it stays, a copy as under inclusive tiers). A
        disk copy stays: it may have been acknowledged as durable (a flush, ``sync: always``), and a block that
        leaves the GPU with a disk copy is freed, never copied into host, so the tiers stay distinct.
        """
        entry = self.h.index.get(key)
        if entry is None or entry.gpu_block is None:
            return
        if entry.host_slot is not None or (self.h.host is not None and self.h.host.contains(key)):
            self.evict_host(key)

    # ------------------------------------------------------------------ disk
    def mark_on_disk(self, key: bytes) -> None:
        """Record that the disk tier now holds ``key`` (if indexed), unless the disk reported losing ``key``
        since the index last recorded it there.

        A put is published after it returns, and another put may evict the block (and a lookup apply that
        eviction) in between: recording it then would make a copy that is gone (a phantom disk hit; a GPU
        or host copy dropped as if the disk had it, its remote ``write_back`` never sent). Left unrecorded,
        a copy that did survive is only unused disk space."""
        if key in self._left_disk:
            del self._left_disk[key]
            return
        entry = self.h.index.get(key)
        if entry is not None:
            entry.on_disk = True

    # --------------------------------------------------------------- losses
    def lost(self, key: bytes, tier: str) -> None:
        """``tier`` no longer has ``key`` (evicted, corrupt, or a load of it failed): clear the record.

        One path for every loss, so a block that cannot be loaded is never
        reported again. A block left in no tier leaves the index with every
        block after it (their prefix is broken).
        """
        entry = self.h.index.get(key)
        if entry is None:
            return
        if tier == "host":
            entry.host_slot = None
        elif tier == "disk":
            if not entry.on_disk:  # a put's publish may still be coming: see mark_on_disk
                self._left_disk[key] = None
                if len(self._left_disk) > LEFT_DISK_MEMORY:
                    self._left_disk.popitem(last=False)
            entry.on_disk = False
        else:
            raise PlacementError(f"lost: {tier!r} is not a lower tier")
        if entry.tier is None:
            self.drop_from(entry)

    def drop_from(self, entry: BlockEntry) -> bool:
        """Remove ``entry`` and every block after it in the index (their prefix is broken).

        Frees the index's GPU references and host slots of what it removes.
        When a request pins any of those nodes the removal is deferred to
        :meth:`reap` and ``False`` is returned; the entry then ends every match.
        """
        node = entry.node
        if node is None:
            return True
        index = self.h.index
        subtree = node.subtree()
        if any(n.pin_count for n in subtree):
            self._homeless[entry.key] = entry
            return False
        if self.h.hand_down is not None:  # the blocks after a broken prefix lose their local copies too
            for n in subtree:
                for e in n.entries[n.entries.index(entry) if n is node else 0:]:
                    if e.gpu_block is not None or e.host_slot is not None:
                        self.h.hand_down(e)
        for n in reversed(subtree[1:]):  # children before parents
            entries = list(n.entries)
            index.remove_leaf(n)
            self._forget(entries)
        keep = node.entries.index(entry)
        self._forget(index.remove_tail(node, keep))
        self._homeless.pop(entry.key, None)
        return True

    def reap(self) -> None:
        """Retry deferred removals whose nodes are no longer pinned."""
        for key, entry in list(self._homeless.items()):
            if entry.node is None or entry.tier is not None:
                self._homeless.pop(key, None)  # gone already, or it found a home again
            else:
                self.drop_from(entry)

    def _forget(self, entries: Iterable[BlockEntry]) -> None:
        """Give back what removed entries held (they are out of the index already); remember their use
        counts (a placement policy's ``use_memory``)."""
        h = self.h
        memory = h.use_memory
        for e in entries:
            if memory is not None:
                memory.remember(e.key, e.hits + 1)
            if e.gpu_block is not None:
                b = e.gpu_block
                self.gpu_lru.discard(b)
                if self._by_block[b] is not None:
                    self._by_block[b] = None
                    self._num_by_block -= 1
                e.gpu_block = None
                h.pool.free([b])
            if e.host_slot is not None and h.host is not None:
                try:
                    h.host.delete([e.key])
                except BlockStateError:
                    pass  # a copy in flight pins the slot; it stays as an unindexed, evictable block
                e.host_slot = None
            e.on_disk = False
            self._left_disk.pop(e.key, None)
            h.counters.dropped_blocks += 1
            h.events.put("dropped", e.key, "index")
