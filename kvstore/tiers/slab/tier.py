"""Slab disk tier: each value written once, with ``O_DIRECT``, into a fixed-size slot of a data file;
only the index (key -> slot) lives in LMDB.

::

    <path>/slots.dat      slot i at i * slot_bytes: codec header + payload (kvstore.tiers.codec), zero padding
    <path>/index/         LMDB: 32-byte key -> <QQ slot, last-access counter> (kvstore.tiers.slab.index)
    <path>/kvstore.lock   one process at a time (kvstore.tiers.datadir)

Why: the LMDB tier copies each value into malloc'd overflow pages, writes them into the page cache
at commit, then fsyncs (docs/BENCHMARKS.md "tiers"); here a put stages its values in a page-aligned
buffer and writes each run of consecutive slots with one ``pwrite`` straight to the device, the
staging of the next run overlapping the writes (two in flight) of the previous ones.

Order of a put (crash safety): data ``pwrite`` -> ``fdatasync`` of the data file (``sync: always``;
under ``interval`` the background sync and ``flush`` fdatasync the data before syncing the index)
-> ONE LMDB write transaction (victims deleted, new slots recorded, pending access times). The
index is never durable before the data it points to.

Slot reuse: free slots are those the index does not reference (derived at open), plus those freed by
eviction and delete. A victim's slot is reused by the same put, before the transaction deleting the
victim commits; a crash in between leaves the victim's key pointing at the new key's value, and a
concurrent get of the victim may read a slot being overwritten. Both are caught by the key-bound
CRC-32 of the header (:func:`kvstore.tiers.codec.decode_into`): every read is verified, and a failure on a
key whose index entry no longer names that slot is a plain miss, otherwise a counted, deleted
``"corrupt"`` miss. Wrong bytes are never served.

Only the ``none`` codec (fixed-size values); ``slab.codec`` refuses others. Capacity is
``max_size // slot_bytes`` slots; the eviction order (the placement policy's) is rebuilt from the
recorded access counters at open. The in-memory ``_slots`` dict is a cache of the index, changed only
under the write lock right after each commit, so reads never open an LMDB transaction.
"""

from __future__ import annotations

import heapq
import logging
import mmap
import os
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import numpy as np

from kvstore.tiers.codec import HEADER_SIZE, as_u8, decode_into, encode_parts
from kvstore.config.schema import SlabConfig
from kvstore.errors import CorruptBlock, TierError
from kvstore.layout import KVLayout
from kvstore.util.ratelog import RateLimitedLog
from kvstore.tiers.base import Buffer, PooledTier, TierStats, VictimHook, check_buffers
from kvstore.tiers.datadir import DirLock, make_private_dir
from kvstore.policy.order import EvictionOrder, order_for
from kvstore.tiers.slab.data_file import Run, SlotFile, runs, slot_bytes
from kvstore.tiers.slab.index import SlabIndex
from kvstore.tiers.sync_loop import SyncLoop
from kvstore.tiers.victims import Handover

log = logging.getLogger(__name__)
WRITES_IN_FLIGHT = 2
"""``pwrite`` requests of one put in flight at once (each from its own staging buffer, one more being staged).
Put at 64 KiB / 4 MiB blocks, 256 MiB, dev VM: 1 in flight of 8 MiB 0.82-0.88 / 1.07-1.44 GB/s, 2 of 4 MiB
1.27-1.40 / 1.46-2.08 GB/s; 3 was not better than 2."""
WRITE_REQUEST = 4 << 20
"""Bytes per ``pwrite`` of consecutive slots (at least one slot)."""
READ_REQUEST = 1 << 20
"""Bytes per read request of a get (at least one slot): decoding one overlaps the reads of the others. 1 MiB
read best on the dev VM against 2 and 8 MiB at 256 KiB blocks (noisy: 0.93-1.08 vs 0.85-1.06 vs 0.69-0.92 GB/s)."""


class SlabTier(PooledTier):
    """Blocks in fixed-size slots of ``<path>/slots.dat``, indexed in LMDB, at most ``max_size`` bytes of slots."""

    name = "slab"
    takes_victim_hook = True

    def __init__(
        self,
        layout: KVLayout,
        path: str | os.PathLike[str],
        max_size: int,
        *,
        codec: str = "none",
        sync: Literal["always", "interval"] = "interval",
        sync_interval_ms: int = 200,
        io_threads: int = 2,
        read_threads: int = 4,
        grow_step: int = 256 << 20,
        order: EvictionOrder | None = None,
        direct_io: bool = True,
    ) -> None:
        """Open (creating) the data file and index, rebuild the free slots and eviction order, start the threads.

        ``order``: the empty eviction order the placement policy built for this tier
        (:meth:`~kvstore.policy.named.PlacementPolicy.orders`; ``None``: LRU).
        """
        if codec != "none":
            raise ValueError(f"slab.codec must be 'none' (fixed-size slots), got {codec!r}")
        super().__init__(layout)
        self.path, self.sync_mode = os.fspath(path), sync
        self._fp, self._itemsize = layout.fingerprint, layout.itemsize
        self.value_len = HEADER_SIZE + layout.bytes_per_block
        self.slot_size = slot_bytes(self.value_len)
        self.capacity = max_size // self.slot_size
        if self.capacity < 1:
            raise TierError(f"slab.max_size {max_size} bytes cannot hold one slot of {self.slot_size} bytes")
        self._lock = threading.RLock()  # the one writer; guards the order, `_slots`, `_free`, `_touched`
        self._order = order_for(order)
        self._slots: dict[bytes, int] = {}
        self._free: list[int] = []  # a heap: the lowest free slot first, so batches land in consecutive slots
        self._touched: dict[bytes, int] = {}
        self._hits: deque[bytes] = deque()
        self._clock = 0
        self._log = RateLimitedLog(log)
        self._handover = Handover(self.name)  # the victim hook (set_victim_hook) and its pending sends
        make_private_dir(self.path)
        self._dirlock = DirLock(self.path, "slab.path")
        try:
            self.index = SlabIndex(os.path.join(self.path, "index"), durable_commits=(sync == "always"),
                                   entries=self.capacity)
            try:
                self.data = SlotFile(os.path.join(self.path, "slots.dat"), self.slot_size, self.capacity, grow_step,
                                     direct=direct_io)
                self._load()
            except BaseException:
                self.index.close()
                raise
        except BaseException:
            self._dirlock.release()
            raise
        stage = max(WRITE_REQUEST, self.slot_size)
        self._stage = [memoryview(mmap.mmap(-1, stage)) for _ in range(WRITES_IN_FLIGHT + 1)]  # page-aligned
        self._dirty = False  # puts not yet synced under `interval`
        self._writer = ThreadPoolExecutor(WRITES_IN_FLIGHT, thread_name_prefix="kvstore-slab-write")
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-slab")
        self.read_threads = read_threads
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="kvstore-slab-read")
        self._closed = False
        self._syncer = SyncLoop(self._background, sync_interval_ms / 1000, "kvstore-slab-sync")

    @classmethod
    def from_config(cls, section: SlabConfig, layout: KVLayout, *, order: EvictionOrder | None = None) -> SlabTier:
        """Build from the ``slab`` section of the config (``order``: see :meth:`__init__`)."""
        return cls(layout, section.directory(), int(section.max_size), codec=section.codec, sync=section.sync,
                   sync_interval_ms=section.sync_interval_ms, io_threads=section.io_threads,
                   read_threads=section.read_threads, grow_step=int(section.grow_step),
                   order=order, direct_io=section.direct_io)

    # ------------------------------------------------------------- queries
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are indexed. Changes nothing."""
        for n, key in enumerate(keys):
            if key not in self._slots:
                return n
        return len(keys)

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is indexed. Changes nothing."""
        return key in self._slots

    def keys(self) -> list[bytes]:
        """Every stored key, next to evict first (a snapshot). Changes nothing."""
        with self._lock:
            return list(self._order)

    # ---------------------------------------------------------------- data
    def get(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        """Read found blocks' slots (runs of consecutive slots, up to ``read_threads`` requests in flight) and
        decode them into ``dests``; every value is verified. Hits become most recently used (applied with the
        next write). A corrupt value still indexed at that slot is deleted, counted and announced."""
        check_buffers(keys, dests, self.layout.bytes_per_block, "slab")
        self._check_open()
        slots = [self._slots.get(k) for k in keys]
        at = [i for i, s in enumerate(slots) if s is not None]
        per = max(1, min(READ_REQUEST // self.slot_size, -(-len(at) // self.read_threads)))
        todo = runs([slots[i] for i in at], per)  # type: ignore[misc]  # None filtered out above
        found = [False] * len(keys)
        bad: list[tuple[bytes, int]] = []
        futures = [self._readers.submit(self._read_run, r, at, keys, dests) for r in todo[1:]]
        results = [self._read_run(todo[0], at, keys, dests)] if todo else []
        results += [f.result() for f in futures]
        for ok, corrupt in results:
            for i in ok:
                found[i] = True
            bad += corrupt
        if bad:
            self._drop_corrupt(bad)
        self._hits.extend(k for k, ok in zip(reversed(keys), reversed(found)) if ok)
        hits = sum(found)
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += len(keys) - hits
            self._stats.bytes_read += hits * self.layout.bytes_per_block
        return found

    def put(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        """Write absent blocks into free slots (``O_DIRECT``, runs of consecutive slots), sync per ``sync``, then
        record them in one index transaction; evicts to stay within the slots. ``False``: no slot could be had."""
        check_buffers(keys, srcs, self.layout.bytes_per_block, "slab")
        with self._lock:
            self._check_open()
            self._apply_hits()
            for key in reversed(keys):  # a put is a use: present keys are not this batch's victims
                if self._order.touch(key):
                    self._clock += 1
                    self._touched[key] = self._clock
            todo = list({k: s for k, s in zip(keys, srcs) if k not in self._slots}.items())
            victims = self._order.victims(len(todo) * self.slot_size, self.capacity * self.slot_size, exclude=keys)
            for key in victims:
                heapq.heappush(self._free, self._slots[key])  # reused at once: see the module docstring
            send = self._handover.offer(victims, self._read_quietly) if victims else None  # before slot reuse
            todo = todo[: len(self._free)]
            new = [heapq.heappop(self._free) for _ in todo]
            try:
                self._write_slots(todo, new)
                if self.sync_mode == "always":
                    self.data.sync()
                clocks = range(self._clock + 1, self._clock + 1 + len(todo))
                self.index.write(victims, [*self._pop_touches(victims), *zip([k for k, _ in todo], new, clocks)])
            except TierError:  # nothing changed in the index: the victims stay (verified on read), the slots free
                held = {self._slots[k] for k in victims}
                self._free = [s for s in [*self._free, *new] if s not in held]
                heapq.heapify(self._free)
                raise
            self._handover.committed(send)  # the victims are out of the index
            self._clock += len(todo)
            for key in victims:
                self._forget(key, "evicted")
            for (key, _), slot in zip(reversed(todo), reversed(new)):  # deepest first (see Tier.put)
                self._slots[key] = slot
                self._order.add(key, self.slot_size)
                self._stats.puts += 1
                self._stats.bytes_written += self.layout.bytes_per_block
            self._dirty = self._dirty or bool(todo)
            stored = [k in self._slots for k in keys]
        self._handover.run_ready()
        return stored

    def set_victim_hook(self, hook: VictimHook | None) -> None:
        """Call ``hook`` with each put's victims while their slots still hold them (:mod:`kvstore.tiers.victims`).

        It runs under the tier's write lock, before the put writes into the victims' slots; its reader reads and
        verifies their slots (and any other stored key's). Its send runs once the index transaction deleting
        them has committed, after the lock is released; a put whose index write failed drops it unrun."""
        self._handover.hook = hook

    def _read_quietly(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        """Read and verify stored blocks into ``dests`` without counting or recency (a victim hook's reader).
        A value failing verification is only ``False`` here: the put under way deletes victims anyway, and a
        corrupt non-victim is found and dropped by its next :meth:`get`."""
        check_buffers(keys, dests, self.layout.bytes_per_block, "slab")
        slots = [self._slots.get(k) for k in keys]
        at = [i for i, s in enumerate(slots) if s is not None]
        found = [False] * len(keys)
        per = max(1, READ_REQUEST // self.slot_size)
        for run in runs([slots[i] for i in at], per):  # type: ignore[misc]  # None filtered out above
            for i in self._read_run(run, at, keys, dests)[0]:
                found[i] = True
        return found

    def seed_uses(self, keys: Sequence[bytes], uses: Sequence[int]) -> None:
        """Restart the eviction order's use counts of stored ``keys`` at ``uses`` (see :meth:`Tier.seed_uses`)."""
        with self._lock:
            for key, n in zip(keys, uses):
                self._order.seed(key, n)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove these keys from the index (one transaction); their slots become free. Returns how many were stored."""
        with self._lock:
            self._check_open()
            doomed = [k for k in dict.fromkeys(keys) if k in self._slots]
            self.index.write(doomed)
            for key in doomed:
                heapq.heappush(self._free, self._slots.pop(key))
                self._order.remove(key)
                self._touched.pop(key, None)
            return len(doomed)

    def flush(self) -> None:
        """Write pending access times, fdatasync the data file, then fsync the index: every put is durable."""
        with self._lock:
            self._check_open()
            self._persist()

    def close(self) -> None:
        """Finish queued async work, flush, stop the threads, close the files. Idempotent."""
        if self._closed:
            return
        self._pool.shutdown(wait=True)
        self.flush()
        self._syncer.stop()
        with self._lock:
            self._closed = True
            self._readers.shutdown(wait=True)
            self._writer.shutdown(wait=True)
            self.index.close()
            self.data.close()
        self._dirlock.release()

    def stats(self) -> TierStats:
        """Counters, with slot bytes used and the capacity in slot bytes."""
        with self._lock:
            self._stats.used_bytes = len(self._slots) * self.slot_size
            self._stats.capacity_bytes = self.capacity * self.slot_size
            self._stats.num_blocks = len(self._slots)
            return super().stats()

    def check_integrity(self) -> None:
        """Assert free + used slots == capacity, no slot twice, and the order mirrors the index cache."""
        with self._lock:
            used = set(self._slots.values())
            assert len(used) == len(self._slots), "two keys share a slot"
            assert not used & set(self._free) and len(used) + len(self._free) == self.capacity
            assert set(self._order) == set(self._slots)

    # ------------------------------------------------------------- private
    def _write_slots(self, todo: list[tuple[bytes, Buffer]], slots: list[int]) -> None:
        """Encode and stage each run of consecutive slots in a page-aligned buffer and ``pwrite`` it; the next
        run is staged (CRC and copy) while up to :data:`WRITES_IN_FLIGHT` earlier ones are written. Returns once
        every write is done (the index must not name a slot before its data is there)."""
        pending: deque[Future[None]] = deque()
        per = max(1, len(self._stage[0]) // self.slot_size)
        for n, run in enumerate(runs(slots, per)):
            stage = self._stage[n % len(self._stage)]
            dst = np.frombuffer(stage, dtype=np.uint8)
            self._fill(dst, todo, run.items)
            pending.append(self._writer.submit(self.data.write, run.first, stage[: len(run.items) * self.slot_size]))
            if len(pending) == len(self._stage) - 1:
                pending.popleft().result()  # the oldest buffer is free again
        for write in pending:
            write.result()

    def _fill(self, dst: np.ndarray, todo: list[tuple[bytes, Buffer]], items: tuple[int, ...]) -> None:
        """Encode ``todo[items[j]]`` into slot ``j`` of the staging buffer ``dst`` (the CRC is most of the cost)."""
        for j in range(len(items)):
            key, src = todo[items[j]]
            raw = as_u8(src)
            parts = encode_parts(raw, "none", 1, self._fp, self._itemsize, key=key)
            off = j * self.slot_size
            dst[off : off + HEADER_SIZE] = np.frombuffer(parts.header, dtype=np.uint8)
            dst[off + HEADER_SIZE : off + self.value_len] = raw

    def _read_run(self, run: Run, at: list[int], keys: Sequence[bytes],
                  dests: Sequence[Buffer]) -> tuple[list[int], list[tuple[bytes, int]]]:
        """Read one run's slots and decode them; (batch positions filled, (key, slot) that failed verification).
        A failed read (EIO) makes the run's blocks misses, counted in ``read_errors``."""
        try:
            view = self.data.read(run.first, len(run.items))
        except OSError as exc:
            self._log.error("unreadable", "slots %d-%d of %s are unreadable (%s), served as misses", run.first,
                            run.first + len(run.items) - 1, self.data.path, exc)
            with self._lock:
                self._stats.read_errors += len(run.items)
            return [], []
        ok: list[int] = []
        bad: list[tuple[bytes, int]] = []
        for j, pos in enumerate(run.items):
            i = at[pos]
            off = j * self.slot_size
            try:
                decode_into(view[off : min(len(view), off + self.value_len)], dests[i], self._fp, keys[i])
                ok.append(i)
            except CorruptBlock as exc:
                bad.append((keys[i], run.first + j))
                self._log.warning("corrupt", "slot %d of %s failed verification: %s", run.first + j, self.data.path, exc)
        return ok, bad

    def _drop_corrupt(self, bad: list[tuple[bytes, int]]) -> None:
        """Delete and announce failed values still indexed at the slot read (others were evicted meanwhile)."""
        with self._lock:
            doomed = [k for k, slot in bad if self._slots.get(k) == slot]
            if not doomed:
                return
            self.index.write(doomed)
            for key in doomed:
                heapq.heappush(self._free, self._slots[key])
                self._forget(key, "corrupt")

    def _forget(self, key: bytes, kind: str) -> None:
        """Drop ``key`` from the cache of the index and the order, count it and emit ``kind`` (lock held)."""
        self._slots.pop(key, None)
        self._order.remove(key)
        self._touched.pop(key, None)
        if kind == "evicted":
            self._stats.evictions += 1
        else:
            self._stats.corrupt_dropped += 1
        self._emit(kind, key)

    def _apply_hits(self) -> None:
        for key in (self._hits.popleft() for _ in range(len(self._hits))):
            if self._order.touch(key):
                self._clock += 1
                self._touched[key] = self._clock

    def _pop_touches(self, skip: Sequence[bytes] = ()) -> list[tuple[bytes, int, int]]:
        """The access times not yet in the index, as index puts (lock held), except for ``skip``; clears them."""
        gone = set(skip)
        out = [(k, self._slots[k], c) for k, c in self._touched.items() if k not in gone]
        self._touched.clear()
        return out

    def _persist(self) -> None:
        """Pending access times, then data fdatasync, then index fsync (lock held): data before index."""
        self._apply_hits()
        if self._touched:
            self.index.write(puts=self._pop_touches())
        self.data.sync()
        self._dirty = False
        self.index.sync()

    def _background(self) -> None:
        """The sync thread's work: under ``interval`` sync pending puts (:meth:`_persist`); else record recency."""
        with self._lock:
            if self._closed:
                return
            if self._dirty and self.sync_mode == "interval":
                self._persist()
            elif self._touched or self._hits:
                self._apply_hits()
                self.index.write(puts=self._pop_touches())

    def _load(self) -> None:
        """Rebuild the slot cache, the free slots and the order (by recorded access counter) from the index.

        Entries naming a slot past the capacity (``max_size`` lowered) or a slot already taken are deleted."""
        records = self.index.records()
        stale: list[bytes] = []
        taken: set[int] = set()
        for clock, key, slot in reversed(records):  # newest first, each before the rest: the oldest ends first
            self._clock = max(self._clock, clock)
            if slot >= self.capacity or slot in taken:
                stale.append(key)  # past the capacity (max_size lowered), or a slot a newer entry holds
                continue
            self._slots[key] = slot
            taken.add(slot)
            self._order.add_oldest(key, self.slot_size)
        if stale:
            self.index.write(stale)
        self._free = [s for s in range(self.capacity) if s not in taken]  # ascending: already a heap

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"slab tier at {self.path} is closed")
