"""Host-RAM tier (L2): a fixed arena of block slots with an eviction order and reference counts.

One file past 500 lines, on purpose: :class:`HostTier` is one slot table (keys to slots, references,
pins, the eviction order) under one lock; the parts that stand alone are beside it in this package
(``arena``, ``free_slots``, ``slot_directory``, ``prefault``).

Plain containers (nano-vllm style): a dict from published key to slot and its
inverse, an eviction order over the published keys (the placement policy's,
``policy.placement``, :mod:`kvstore.policy`; each slot accounted as 1), a dict of reserved slots, a dict of reference counts and a
list of free slots. Every state change happens under one lock; the byte
copies happen outside it, on slots that hold a reference so nothing can evict
or reuse them meanwhile.

A slot is in exactly one of three states::

    free ──reserve/put──► reserved (pinned, invisible) ──publish──► published (in the eviction order)
      ▲                          │ abort                                │ evict / delete
      └──────────────────────────┴──────────────────────────────────────┘

Deleting a pinned key raises :class:`BlockStateError` and changes nothing
(raising, not deferring, so a caller never sees a key that is both gone and
still occupying memory).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvstore.config.schema import HostConfig
from kvstore.errors import BlockStateError, IntegrityError, TierError, short_key
from kvstore.layout import KVLayout
from kvstore.tiers.shared_capacity import SharedCapacity
from kvstore.tiers.host.arena import HostArena, PinMode, SlotCopy, copy_split, resolve_pin
from kvstore.tiers.base import Buffer, Tier, TierStats, buffer_addresses
from kvstore.policy.order import EvictionOrder, order_for
from kvstore.policy.exclude import Exclude, KeyFilter
from kvstore.tiers.host.free_slots import FreeSlots
from kvstore.tiers.host.slot_directory import DirectoryWriter, directory_bytes


class _Pinned(KeyFilter):
    """``key in pinned``: ``key`` is published in a slot holding a reference (read from the tier's maps)."""

    __slots__ = ("_slots", "_refs")

    def __init__(self, slots: dict[bytes, int], refs: dict[int, int]) -> None:
        self._slots, self._refs = slots, refs

    def __contains__(self, key: object) -> bool:
        slot = self._slots.get(key)  # type: ignore[call-overload]  # any key: absent ones are not pinned
        return slot is not None and slot in self._refs


class HostTier(Tier):
    """Blocks in (optionally pinned, optionally shared) host memory."""

    name = "host"

    def __init__(
        self,
        layout: KVLayout,
        capacity_bytes: int,
        *,
        pin_memory: PinMode = "auto",
        shared_memory: bool = False,
        label: str = "kvstore-host",
        auto_evict: bool = True,
        order: EvictionOrder | None = None,
        prefault: bool = True,
        shared_capacity: SharedCapacity | None = None,
        max_slots: int | None = None,
    ) -> None:
        """Allocate ``capacity_bytes // bytes_per_block`` slots now, at most ``max_slots``.

        ``max_slots``: bounds the slots (and so the bookkeeping) of a layout a client chose (a daemon's
        ``daemon.max_layout_slots``); the memory a slot costs before it is used is the slot directory's, a few
        dozen bytes, and nothing else (:class:`~kvstore.tiers.host.free_slots.FreeSlots`).

        ``shared_capacity``: the bytes of slots in use are counted against a budget several tiers share (one per
        KV layout of a daemon, :mod:`kvstore.tiers.shared_capacity`); the arena's pages are then given back
        whenever a slot is freed, and not prefaulted.

        ``shared_memory``: the arena is a sealed memfd whose descriptor (:attr:`arena` ``.fd``) other processes
        map (:mod:`kvstore.tiers.host.arena`), ``label`` naming it in logs and ``/proc/<pid>/maps``.

        ``prefault``: map the arena's pages on a background thread from now on (``host.prefault``,
        :mod:`kvstore.tiers.host.prefault`), so puts into fresh slots take no page faults.

        ``auto_evict=False`` makes ``put``/``reserve`` fail instead of evicting,
        so the tiered store can spill the :meth:`victims` to disk first.
        ``order``: the empty eviction order the placement policy built for this tier
        (:meth:`~kvstore.policy.named.PlacementPolicy.orders`); ``None``: LRU.
        """
        super().__init__(layout)
        self.bpb = layout.bytes_per_block
        num_slots = capacity_bytes // self.bpb
        if max_slots is not None:
            num_slots = min(num_slots, max_slots)
        self.arena = HostArena.allocate(
            num_slots, self.bpb, pin=resolve_pin(pin_memory), label=label, shared=shared_memory,
            tail_bytes=directory_bytes(num_slots) if shared_memory and num_slots > 0 else 0,
        )
        self.capacity = shared_capacity
        self.last_use = 0.0
        """``time.monotonic()`` of the last reserve or pin (under a shared budget: who gives way first)."""
        self.shed_guard: threading.Lock | None = None
        """A lock of the tier's owner that :meth:`shed` must also get at once (or shed nothing): a daemon's backend
        reads a slot and pins it under its own mutex, and no other layout's put may evict in between."""
        if prefault and shared_capacity is None:
            self.arena.prefault("host tier")
        self.directory: DirectoryWriter | None = (
            DirectoryWriter(self.arena.tail.numpy(), num_slots) if self.arena.tail is not None else None)
        """The published keys' slots in the shared segment, for clients that read without a round trip
        (:mod:`kvstore.tiers.host.slot_directory`); ``None`` for private memory."""
        self.auto_evict = auto_evict
        self._lock = threading.Lock()
        self._slots: dict[bytes, int] = {}  # published key -> slot
        self._keys: dict[int, bytes] = {}  # its inverse, changed with it
        self._order: EvictionOrder = order_for(order)  # the published keys, 1 unit each
        self._reserved: dict[bytes, int] = {}
        self._refs: dict[int, int] = {}  # slot -> reference count, only while > 0
        self._pinned = _Pinned(self._slots, self._refs)  # what victims skip (reads the two maps above)
        self._free = FreeSlots(self.arena.num_slots)  # pop() gives slot 0 first
        # Big batches are copied on two threads (the arena's memmove releases the GIL), as a machine's memcpy would.
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-host-copy")
        if shared_capacity is not None:
            shared_capacity.join(self)

    @classmethod
    def from_config(cls, section: HostConfig, layout: KVLayout, *, auto_evict: bool = True,
                    order: EvictionOrder | None = None) -> HostTier:
        """Build from the ``host`` section of the config (``order``: see :meth:`__init__`)."""
        return cls(
            layout,
            int(section.capacity),
            pin_memory=section.pin_memory,
            shared_memory=section.shared_memory,
            auto_evict=auto_evict,
            order=order,
            prefault=section.prefault,
        )

    # ------------------------------------------------------------- slots
    @property
    def num_slots(self) -> int:
        """Slots in the arena."""
        return self.arena.num_slots

    @property
    def num_free_slots(self) -> int:
        """Slots neither published nor reserved."""
        return len(self._free)

    @property
    def room_slots(self) -> int:
        """Slots this tier can fill: its arena's, or fewer when a shared budget is smaller. Changes nothing."""
        if self.capacity is None:
            return self.num_slots
        return min(self.num_slots, self.capacity.limit // self.bpb)

    @property
    def clean_room(self) -> int:
        """Slots a reserve could take now without waiting for anyone: free slots (under a shared budget, as many
        as its unused bytes pay for) and published slots holding no reference (evictable). Changes nothing."""
        with self._lock:
            free = len(self._free)
            unreferenced = self.num_slots - free - len(self._refs)  # published or reserved, minus those held
            if self.capacity is not None:
                free = min(free, max(0, self.capacity.limit - self.capacity.used) // self.bpb)
            return unreferenced + free

    @property
    def shm_name(self) -> str | None:
        """The label of the shared arena other processes map (``None`` if private)."""
        return self.arena.name

    def slot_of(self, key: bytes) -> int | None:
        """Slot of a published key, else ``None``. Changes nothing (not even the eviction order)."""
        return self._slots.get(key)

    def slot_view(self, slot: int) -> torch.Tensor:
        """Zero-copy view of ``slot``. Hold a :meth:`pin` on its key while using it."""
        return self.arena.slot_view(slot)

    def pin(self, keys: Sequence[bytes], use: bool = True) -> list[int | None]:
        """Add a reference to each published or reserved key and return its slot (``None``: absent, not pinned).

        A pinned slot is never evicted, deleted or reused. Pinning a published key to read it for a request
        counts as a use of it (LRU: most recently used); ``use=False`` for the store's own reads (a victim
        copied down, a copy written to disk or the remote tier), which are not uses: counted as hits they
        would skew a frequency order and a duel's scores.
        """
        if use:
            self.last_use = time.monotonic()
        with self._lock:
            out: list[int | None] = []
            for key in keys:
                slot = self._slots.get(key)
                if slot is None:
                    slot = self._reserved.get(key)
                if slot is not None:
                    self._refs[slot] = self._refs.get(slot, 0) + 1
                out.append(slot)
            if use:
                self._touch(keys)
            return out

    def touch(self, keys: Sequence[bytes]) -> int:
        """Count a use of each published key (deepest first, as :meth:`get` does) without reading it; returns
        how many are published. For reads made elsewhere (the daemon's clients, through the slot directory)."""
        with self._lock:
            found = [k for k in keys if k in self._slots]
            self._touch(found)
            return len(found)

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Drop one reference per key; raises :class:`BlockStateError` (changing nothing) if one is not pinned."""
        with self._lock:
            slots: list[int] = []
            need: dict[int, int] = {}
            for key in keys:
                slot = self._slot_any(key)
                if slot is not None:
                    need[slot] = need.get(slot, 0) + 1
                if slot is None or self._refs.get(slot, 0) < need[slot]:
                    raise BlockStateError(f"unpin of host block {short_key(key)} that is not pinned")
                slots.append(slot)
            for slot in slots:
                self._deref(slot)

    @property
    def num_pinned(self) -> int:
        """Slots holding at least one reference (pins and reservations). Changes nothing."""
        with self._lock:
            return len(self._refs)

    def victims(self, n: int) -> list[bytes]:
        """Up to ``n`` unpinned published keys, the next to evict first (in the placement policy's order).

        Membership is unchanged (the caller deletes those it evicts); like the
        order's ``victims`` it may change the order itself (S3-FIFO's queues,
        GDSF's inflation), so call it only when about to evict.
        """
        with self._lock:
            return self._victims(n)

    def oldest(self, n: int, exclude: Exclude = ()) -> list[bytes]:
        """Up to ``n`` published keys, pinned or not, the next to evict first, skipping ``exclude``. Changes nothing
        (not even the order): for a caller that writes blocks back before they are evicted (the daemon's dirty
        blocks, which stay pinned until written), in the order eviction will want their slots."""
        with self._lock:
            return self._order.oldest(n, exclude)

    def seed_uses(self, keys: Sequence[bytes], uses: Sequence[int]) -> None:
        """Tell the eviction order how often each published key was used before it entered this tier.

        GDSF restarts a key's count at ``uses`` (priority ``L + uses``); LRU and
        S3-FIFO ignore it. Absent keys are skipped.
        """
        with self._lock:
            for key, n in zip(keys, uses):
                if key in self._slots:
                    self._order.seed(key, n)

    def reserve(self, keys: Sequence[bytes]) -> list[int | None]:
        """Take a pinned, invisible slot per key for a block about to be written into :meth:`slot_view`.

        Free slots first, then (if ``auto_evict``) the least recently used
        unpinned blocks, announced as ``"evicted"``. ``None`` for a key means no
        slot could be made now; it never waits. Keys already published or
        reserved (or repeated) raise :class:`BlockStateError` before anything changes.
        """
        with self._lock:
            self._check_open()
            seen: set[bytes] = set()
            for key in keys:
                if key in self._slots or key in self._reserved or key in seen:
                    raise BlockStateError(f"reserve of host block {short_key(key)} that is already present or reserved")
                seen.add(key)
            return self._reserve_many(keys)

    def publish(self, keys: Sequence[bytes]) -> None:
        """Make reserved keys visible (added to the eviction order) and drop the reservation's reference."""
        with self._lock:
            reserved = self._reserved
            for key in keys:
                if key not in reserved:
                    raise BlockStateError(f"publish of host block {short_key(key)} that is not reserved")
            published, inverse, order, refs = self._slots, self._keys, self._order, self._refs
            slots = [reserved[key] for key in keys]
            if self.directory is not None:
                self.directory.published(keys, slots)
            for key, slot in zip(keys, slots):
                del reserved[key]
                published[key] = slot
                inverse[slot] = key
                order.add(key, 1)
                count = refs[slot] - 1
                if count:
                    refs[slot] = count
                else:
                    del refs[slot]
            self._stats.puts += len(keys)
            self._stats.bytes_written += len(keys) * self.bpb

    def abort(self, keys: Sequence[bytes]) -> None:
        """Return reserved slots to the free list; raises if a key is not reserved or is pinned by someone else."""
        with self._lock:
            for key in keys:
                slot = self._reserved.get(key)
                if slot is None or self._refs.get(slot, 0) != 1:
                    raise BlockStateError(f"abort of host block {short_key(key)} that is not reserved, or is pinned")
            slots = []
            for key in keys:
                slot = self._reserved.pop(key)
                del self._refs[slot]
                slots.append(slot)
            self._to_free(slots)

    # ------------------------------------------------------------ Tier API
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are published. Changes nothing."""
        n = 0
        for key in keys:
            if key not in self._slots:
                break
            n += 1
        return n

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is published. Changes nothing."""
        return key in self._slots

    def keys(self) -> list[bytes]:
        """Every published key, next to evict first (a snapshot of the eviction order). Changes nothing."""
        with self._lock:
            return list(self._order)

    def get(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        """Copy published blocks into ``dests``; counts a use of each. The slot stays pinned during the copy."""
        addrs = buffer_addresses(keys, dests, self.bpb, "host")
        with self._lock:
            self._check_open()
            published, refs = self._slots, self._refs
            slots = [published.get(key) for key in keys]
            for slot in slots:
                if slot is not None:
                    refs[slot] = refs.get(slot, 0) + 1
            self._touch(keys)
        found = [(slot, addr) for slot, addr in zip(slots, addrs) if slot is not None]
        try:
            self._copy(self.arena.read_slots, [s for s, _ in found], [a for _, a in found])
        finally:
            with self._lock:
                for slot, _ in found:
                    self._deref(slot)
                self._stats.hits += len(found)
                self._stats.misses += len(slots) - len(found)
                self._stats.bytes_read += len(found) * self.bpb
        return [s is not None for s in slots]

    def put(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        """Store blocks in new slots (evicting unpinned ones in eviction order if ``auto_evict``).

        A key already published counts a use and is reported
        ``True``; a key reserved by someone else reports ``False``, as does a
        key for which no slot could be made.
        """
        addrs = buffer_addresses(keys, srcs, self.bpb, "host")
        first: dict[bytes, int] = {}
        new: list[int] = []
        result = [False] * len(keys)
        with self._lock:
            self._check_open()
            for i, key in enumerate(keys):
                if key in first:
                    continue
                first[key] = i
                if key in self._slots:
                    self._order.touch(key)
                    result[i] = True
                elif key not in self._reserved:
                    new.append(i)
            slots = self._reserve_many([keys[i] for i in new])
        todo = [(i, keys[i], slot) for i, slot in zip(new, slots) if slot is not None]
        try:
            self._copy(self.arena.write_slots, [slot for _, _, slot in todo], [addrs[i] for i, _, _ in todo])
        except BaseException:
            self.abort([key for _, key, _ in todo])
            raise
        self.publish([key for _, key, _ in reversed(todo)])  # deepest first (see Tier.put)
        for i, _, _ in todo:
            result[i] = True
        return [result[first[key]] for key in keys]

    def delete(self, keys: Sequence[bytes]) -> int:
        """Free the slots of published keys; raises :class:`BlockStateError` (changing nothing) if one is pinned or reserved."""
        with self._lock:
            for key in keys:
                slot = self._slots.get(key)
                if key in self._reserved or (slot is not None and slot in self._refs):
                    raise BlockStateError(f"delete of host block {short_key(key)} while it is pinned")
            freed = self._unpublish_many([k for k in dict.fromkeys(keys) if k in self._slots])
            self._to_free(freed)
            return len(freed)

    def shed(self, nbytes: int, wait_s: float = 0.0) -> int:
        """Evict unpinned blocks worth at least ``nbytes`` for another tier sharing the budget, waiting up to
        ``wait_s`` seconds for the owner's :attr:`shed_guard` and this tier's lock (``0``: a busy tier sheds
        nothing; see :mod:`kvstore.tiers.shared_capacity` for why a wait cannot deadlock); bytes freed."""
        deadline = time.monotonic() + wait_s
        guard = self.shed_guard
        if guard is not None and not guard.acquire(timeout=wait_s):
            return 0
        try:
            return self._shed(nbytes, max(0.0, deadline - time.monotonic()))
        finally:
            if guard is not None:
                guard.release()

    def _shed(self, nbytes: int, wait_s: float) -> int:
        if not self._lock.acquire(timeout=wait_s):
            return 0
        try:
            if self.arena.tensor is None:
                return 0
            victims = self._victims(-(-nbytes // self.bpb))
            self._to_free(self._unpublish_many(victims))
            self._stats.evictions += len(victims)
            self._emit_many("evicted", victims)
            return len(victims) * self.bpb
        finally:
            self._lock.release()

    def used_bytes(self) -> int:
        """Bytes of the slots in use (published or reserved)."""
        return (self.num_slots - len(self._free)) * self.bpb

    def count_served(self, n: int) -> None:
        """Count ``n`` blocks another party read out of the arena itself (a daemon client through shared memory,
        or the daemon copying for one) as :meth:`get` counts its own: hits and bytes read, so a tier's
        ``bytes_read`` agrees with its hits however the bytes left."""
        with self._lock:
            self._stats.hits += n
            self._stats.bytes_read += n * self.bpb

    def stats(self) -> TierStats:
        """Counters, with ``used_bytes``/``capacity_bytes``/``num_blocks`` filled from the arena."""
        with self._lock:
            self._stats.num_blocks = len(self._slots)
            self._stats.used_bytes = (self.num_slots - len(self._free)) * self.bpb
            self._stats.capacity_bytes = self.num_slots * self.bpb
            return super().stats()

    def close(self) -> None:
        """Release the arena (unpin, unmap, unlink the owned segment). Later calls raise :class:`TierError`."""
        with self._lock:
            if self.capacity is not None:
                self.capacity.leave(self)
            self.directory = None  # its arrays map the segment: dropped before the arena unmaps it
            self.arena.close()
            self._slots.clear()
            self._keys.clear()
            self._order = order_for(None)
            self._reserved.clear()
        self._copier.shutdown(wait=True)

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` unless free + published + reserved slots partition the arena."""
        with self._lock:
            used = list(self._slots.values()) + list(self._reserved.values()) + list(self._free)
            if sorted(used) != list(range(self.num_slots)):
                raise IntegrityError(f"host slots do not partition the arena: {len(used)} entries for {self.num_slots}")
            if self._keys != {slot: key for key, slot in self._slots.items()} or set(self._order) != set(self._slots):
                raise IntegrityError("host slot map, its inverse and the eviction order disagree")
            occupied = set(self._slots.values()) | set(self._reserved.values())
            if not set(self._refs) <= occupied or any(c <= 0 for c in self._refs.values()):
                raise IntegrityError("host reference count on a free slot, or a non-positive count")
            if any(slot not in self._refs for slot in self._reserved.values()):
                raise IntegrityError("a reserved host slot lost its reservation reference")
            wrong = self.directory.check(self._slots) if self.directory is not None else None
            if wrong is not None:
                raise IntegrityError(f"host slot directory disagrees with the published slots: {wrong}")

    # ------------------------------------------------------------- private
    def _slot_any(self, key: bytes) -> int | None:
        slot = self._slots.get(key)
        return self._reserved.get(key) if slot is None else slot

    def _deref(self, slot: int) -> None:
        count = self._refs[slot] - 1
        if count:
            self._refs[slot] = count
        else:
            del self._refs[slot]

    def _reserve_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """Reserve a slot for each of ``keys`` (distinct, absent), making room for all of them at once; ``None``
        where none is left. Hold the lock."""
        if self.capacity is not None:
            return self._reserve_shared(keys)
        self._make_room(len(keys))
        free, reserved, refs = self._free, self._reserved, self._refs
        out: list[int | None] = []
        for key in keys:
            if not free:
                out.extend([None] * (len(keys) - len(out)))
                break
            slot = free.pop()
            reserved[key] = slot
            refs[slot] = 1
            out.append(slot)
        return out

    def _reserve_shared(self, keys: Sequence[bytes]) -> list[int | None]:
        """:meth:`_reserve_many` under a shared budget: granted bytes first, then this tier's own victims (their
        slots change hands, the budget does not), then what the other tiers shed (waiting up to the budget's
        ``wait_s`` for a busy one: a flooded layout must not starve this one's puts). Hold the lock."""
        assert self.capacity is not None
        n, bpb = len(keys), self.bpb
        now = time.monotonic()
        before, self.last_use = self.last_use or now, now  # a tier new to the budget: anyone idler than now
        granted = self.capacity.take(n, bpb)
        if granted < n and self.auto_evict and self.capacity.reclaim((n - granted) * bpb, self, idler_than=before):
            granted += self.capacity.take(n - granted, bpb)  # room from layouts idler than this one
        if granted < n and self.auto_evict:
            victims = self._victims(n - granted)
            self._free.extend(sorted(self._unpublish_many(victims), reverse=True))
            self._stats.evictions += len(victims)
            self._emit_many("evicted", victims)
            granted += len(victims)
        if granted < n and self.auto_evict:  # from any other layout, waiting a bounded time for a busy one
            capacity = self.capacity

            def lacking() -> int:
                nonlocal granted
                granted += capacity.take(n - granted, bpb)
                return (n - granted) * bpb

            capacity.reclaim_waiting(lacking, self)
        if granted > len(self._free):  # never the case while the arenas hold the whole budget; kept exact anyway
            self.capacity.give(granted - len(self._free), bpb)
            granted = len(self._free)
        out: list[int | None] = []
        for key in keys[:granted]:
            slot = self._free.pop()
            self._reserved[key] = slot
            self._refs[slot] = 1
            out.append(slot)
        return out + [None] * (n - granted)

    def _to_free(self, slots: list[int]) -> None:
        """Put freed slots back on the free list (handed out again lowest first, see :meth:`_make_room`); under a
        shared budget, give their bytes back and their pages to the kernel. Hold the lock."""
        self._free.extend(sorted(slots, reverse=True))
        if self.capacity is not None and slots:
            self.capacity.give(len(slots), self.bpb)
            self.arena.release_slots(slots)

    def _make_room(self, n: int) -> None:
        """With ``auto_evict``, evict unpinned blocks (one :meth:`_victims` call, in eviction order) until ``n``
        slots are free or none can be. Hold the lock."""
        short = n - len(self._free)
        if short <= 0 or not self.auto_evict:
            return
        victims = self._victims(short)
        # Handed out again lowest slot first: victims of one earlier batch sit in consecutive slots (whatever
        # order the eviction order names them in), so the batch that reuses them gets consecutive, ascending
        # slots too, which the arena copies in runs (copy_runs).
        self._free.extend(sorted(self._unpublish_many(victims), reverse=True))
        self._stats.evictions += len(victims)
        self._emit_many("evicted", victims)

    def _victims(self, n: int) -> list[bytes]:
        """:meth:`victims` with the lock held; pinned keys are skipped by a live test (:class:`_Pinned`), so a
        call costs the keys it visits, not one pass over every pin and reservation."""
        return self._order.victims(n, len(self._order), exclude=self._pinned)

    def _unpublish_many(self, keys: Sequence[bytes]) -> list[int]:
        """Forget published, distinct ``keys`` (slot map, inverse, order, directory); their slots, in order.
        Hold the lock."""
        slots = [self._slots.pop(key) for key in keys]
        if self.directory is not None:
            self.directory.unpublished(slots)  # readers stop trusting them before anyone can reuse them
        inverse, order = self._keys, self._order
        for key, slot in zip(keys, slots):
            del inverse[slot]
            order.remove(key)
        return slots

    def _copy(self, copy: SlotCopy, slots: list[int], addrs: list[int]) -> None:
        """``copy(slots, addrs)`` (an arena read or write), split over two threads when large (:func:`copy_split`)."""
        copy_split(copy, slots, addrs, self.bpb, lambda: self._copier)

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Count a use of published keys, deepest first (see :meth:`Tier.get`). Hold the lock."""
        order = self._order
        for key in reversed(keys):
            order.touch(key)

    def _check_open(self) -> None:
        if self.arena.tensor is None:
            raise TierError("host tier is closed")


