"""Disk tier (L3): blocks in an LMDB environment, content-addressed, capped, LRU-evicted.

One file past 500 lines, on purpose: :class:`DiskTier`'s writes, eviction and use counts meet in one
LMDB write transaction over one environment, one eviction order and one byte budget; the parts that stand
alone are beside it in this package (``env``, ``reads``, ``value``, ``walk``, ``gate``, ``check``, ``repair``).

Two named databases::

    blocks  32-byte key -> codec header + payload (see kvstore.tiers.codec)
    lru     32-byte key -> <QQ last-access counter, accounted bytes>

The data is found through ``blocks`` alone, so a restarted process serves
every block with no rebuild. ``lru`` is read once at open (a few dozen bytes
per block) so eviction after a restart starts from the coldest blocks.
Accesses by ``get`` are recorded in memory and written to ``lru`` with the
next write transaction, by the background thread every
``sync_interval_ms``, and on ``flush``/``close``; a crash forgets at most
that window of recency, never data.

Capacity: the map (and hence ``data.mdb``, which LMDB never grows past the
map) starts at ``map_step`` and grows in ``map_step`` steps, never past
``max_size``. Each block is accounted for the pages it occupies (overflow
pages rounded up, leaf nodes doubled for half-full pages, its ``lru``
record), and eviction keeps that sum under ``max_size`` minus a reserve for
meta, branch and freelist pages. If LMDB still reports a full map
(fragmented free space), the put evicts more and retries; ``MapFullError``
never reaches a caller.

Durability (``sync``):

- ``always``: every commit is fsynced before ``put`` returns. A put is durable
  when acknowledged; each batch pays one fsync (milliseconds on NVMe).
- ``interval``: commits are not fsynced; a background thread syncs every
  ``sync_interval_ms`` or once ``sync_bytes`` are pending. Much higher put
  rate; a process crash (kill -9 included) loses nothing (the page cache has
  it). An OS crash or power loss loses the last window, and LMDB documents
  that without fsync it may also leave pages of that window torn: a torn value
  fails its checksum and is a miss, a torn page is a counted read error (a
  miss) and a clear :class:`TierError` naming ``kvstore repair`` on write,
  never a wrong block. ``flush()`` forces a sync. A large put is committed
  in transactions of about :data:`TXN_BYTES` (LMDB commits a 4-16 MiB
  transaction several times slower than a 1-2 MiB one on this machine).

Reads: a large get is split into up to ``read_threads`` contiguous runs read
at once, each in its own read transaction; cold reads rely on kernel
readahead (``readahead=True``; :mod:`kvstore.tiers.lmdb.reads` says why).
The environment's opening, growth and error mapping are
:mod:`kvstore.tiers.lmdb.env`.

Files: the directory is 0700 and its files 0600 (narrowed if found wider), and
the tier holds ``<path>/kvstore.lock`` (:mod:`kvstore.tiers.datadir`) while
open: a second process on the same environment is refused, naming the holder.
``data.mdb`` is checked against its meta pages before it is mapped
(:mod:`kvstore.tiers.lmdb.check`): a truncated or foreign file is refused with
:class:`TierError` naming it and ``kvstore repair`` (:mod:`kvstore.tiers.lmdb.repair`),
never mapped into a ``SIGBUS``. At run time an LMDB error reading one block
(a damaged page) makes that block a miss, counted in ``read_errors`` and
logged at most once per interval; a failed write raises :class:`TierError`.

Threads: reads run in their own read transactions and never wait for a
writer: hits are queued (a ``deque``, atomic appends) and moved up in the LRU
order by the next holder of the write lock (put, flush, background thread),
always before eviction picks victims. Writes are serialised by that lock
(LMDB allows one writer). ``get_async``/``put_async`` run on ``io_threads``.

Victims: an owner may see every capacity eviction before it happens
(:meth:`DiskTier.set_victim_hook`, :mod:`kvstore.tiers.victims`): the hook
reads the victims in the transaction that deletes them, and what it hands
back runs after the commit, outside the write lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import lmdb

from kvstore.tiers.codec import CODECS, EncodedParts, encode_parts, encoded_size_bound
from kvstore.config.schema import DiskConfig
from kvstore.errors import CorruptBlock, TierError, short_key
from kvstore.layout import KVLayout
from kvstore.util.ratelog import RateLimitedLog
from kvstore.tiers.base import Buffer, PooledTier, TierStats, VictimHook, VictimSend, check_buffers
from kvstore.tiers.datadir import DirLock, make_private_dir
from kvstore.policy.order import EvictionOrder, order_for
from kvstore.tiers.lmdb.env import LRU_RECORD, LmdbEnv
from kvstore.tiers.lmdb.reads import RunReader, split_runs, txn_reader
from kvstore.tiers.shared_capacity import SharedCapacity
from kvstore.tiers.lmdb.value import ValueOutOfBounds
from kvstore.tiers.lmdb.check import damaged, repair_hint
from kvstore.tiers.sync_loop import SyncLoop
from kvstore.tiers.unsynced import UnsyncedBytes
from kvstore.tiers.victims import Handover

log = logging.getLogger(__name__)
_CLOCK_KEY = b"clock"  # in `lru`: the last access counter (block keys are 32 bytes, so no clash)
TXN_BYTES = 1 << 20
"""About how many value bytes one write transaction of :meth:`DiskTier.put` commits under ``sync: interval``.
Measured here (docs/BENCHMARKS.md, "LMDB transaction size"): transactions of 1-2 MiB commit at 1.0-1.4 GB/s,
of 4-16 MiB at 0.25-0.6 GB/s with most of the time in the kernel, whatever the block size."""


class DiskTier(PooledTier):
    """Blocks in LMDB at ``path``, at most ``max_size`` bytes on disk."""

    name = "lmdb"
    takes_victim_hook = True

    def __init__(
        self,
        layout: KVLayout,
        path: str | os.PathLike[str],
        max_size: int,
        *,
        codec: str = "none",
        codec_level: int = 1,
        sync: Literal["always", "interval"] = "interval",
        sync_interval_ms: int = 200,
        sync_bytes: int = 64 << 20,
        io_threads: int = 2,
        read_threads: int = 4,
        map_step: int = 64 << 20,
        readahead: bool = True,
        order: EvictionOrder | None = None,
        shared_capacity: SharedCapacity | None = None,
    ) -> None:
        """Open (creating if needed) the environment and load the LRU order; starts the I/O and sync threads.

        ``shared_capacity``: this environment's blocks and those of the other tiers sharing it (one LMDB per KV
        layout of a daemon, :mod:`kvstore.tiers.shared_capacity`) stay under its limit together.

        ``readahead=False``: LMDB's ``MADV_RANDOM`` map, every cold page a separate read (module docstring).
        ``order``: the empty eviction order the placement policy built for this tier
        (:meth:`~kvstore.policy.named.PlacementPolicy.orders`; ``None``: LRU); see :meth:`_load_lru` for reopen.
        ``read_threads``: how many runs one large get is read in at once (:meth:`get`); 1 reads on the caller's thread.
        """
        if read_threads < 1:
            raise ValueError(f"disk.read_threads must be at least 1, got {read_threads}")
        chosen = order_for(order)  # refused before anything is opened
        super().__init__(layout)
        CODECS.get(codec)  # unknown names fail here, not on the first put
        self.path = os.fspath(path)
        self.codec, self.codec_level, self.sync_mode = codec, codec_level, sync
        self._fp, self._itemsize = layout.fingerprint, layout.itemsize
        make_private_dir(self.path)
        self._dirlock = DirLock(self.path, "disk.path")  # before LMDB sees the files: one process per environment
        try:
            self._lmdb = LmdbEnv(self.path, max_size, map_step, sync=sync == "always", readahead=readahead)
        except BaseException:
            self._dirlock.release()
            raise
        self.env = self._lmdb.env
        self.max_size = self._lmdb.max_size
        try:
            if self._lmdb.budget < self._lmdb.cost(layout.bytes_per_block + 64):
                raise TierError(f"disk.max_size {max_size} bytes cannot hold one block of {layout.bytes_per_block} bytes")
            try:
                self._blocks = self.env.open_db(b"blocks")
                self._lru_db = self.env.open_db(b"lru")
            except lmdb.Error as exc:
                raise damaged(self.path, f"cannot be read ({exc})") from None
        except BaseException:
            self._lmdb.close()
            self._dirlock.release()
            raise
        self._write_lock = threading.RLock()  # one writer; also guards the in-memory LRU
        self._scratch = bytearray()  # one value being written (write lock held); see _write
        self._hits: deque[bytes] = deque()  # keys found by `get`, not yet moved up in `_lru` (see _apply_hits)
        self._read_stats_lock = threading.Lock()  # get's counters, so a read never waits for a commit
        self._gate = self._lmdb.gate
        self._log = RateLimitedLog(log)  # corrupt values, unreadable pages: once per interval, not per block
        self._lru = chosen  # the eviction order; named `_lru` for the database it mirrors
        self._handover = Handover(self.name)  # the victim hook (set_victim_hook) and its pending sends
        self._touched: dict[bytes, int] = {}  # key -> access counter not yet written to `lru`
        self._clock = 0
        self._max_value = encoded_size_bound(layout.bytes_per_block)
        """The longest value a block encodes to: a value LMDB says is longer is damaged, never touched."""
        try:
            self._load_lru()
        except lmdb.Error as exc:
            self.env.close()
            self._dirlock.release()
            raise damaged(self.path, f"cannot be read ({exc})") from None
        self._unsynced = UnsyncedBytes()  # bytes committed since the last fsync (``interval``)
        self._closing = False
        self.sync_interval_s, self.sync_bytes = sync_interval_ms / 1000, sync_bytes
        self._syncer = SyncLoop(self._background, self.sync_interval_s, "kvstore-lmdb-sync", self.path)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-lmdb")
        self.read_threads = read_threads
        # Runs of a get beyond the caller's own; a pool apart from `_pool`, whose tasks (get_async) wait on these.
        self._readers = ThreadPoolExecutor(max(1, read_threads - 1), thread_name_prefix="kvstore-lmdb-read")
        self._runs = RunReader(self._lmdb, self._blocks, self._fp, self._max_value, self._log_unreadable,
                               self._log_corrupt)
        self.capacity = shared_capacity
        self.last_use = 0.0
        """``time.monotonic()`` of the last read or write (under a shared capacity: who gives way first)."""
        if shared_capacity is not None:
            shared_capacity.join(self)

    @classmethod
    def from_config(cls, section: DiskConfig, layout: KVLayout, *, order: EvictionOrder | None = None,
                    shared_capacity: SharedCapacity | None = None) -> DiskTier:
        """Build from the ``disk`` section of the config (``order``, ``shared_capacity``: see :meth:`__init__`)."""
        return cls(
            layout, section.directory(), int(section.max_size), codec=section.codec, codec_level=section.codec_level,
            sync=section.sync, sync_interval_ms=section.sync_interval_ms, sync_bytes=int(section.sync_bytes),
            io_threads=section.io_threads, read_threads=section.read_threads, order=order,
            shared_capacity=shared_capacity,
        )

    # ------------------------------------------------------------- queries
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (one read transaction). Changes nothing.

        Uses ``Cursor.set_key``: ``Transaction.get`` would fault in every page of each value (py-lmdb's preload).
        """
        n = 0
        try:
            with self._gate.reading(), self.env.begin(db=self._blocks, buffers=True) as txn:
                cursor = txn.cursor()
                for n, key in enumerate(keys):
                    if not cursor.set_key(key):
                        return n
        except lmdb.Error as exc:  # a damaged page: the prefix ends there (get counts it when asked)
            self._log_unreadable(keys[n], exc)
            return n
        return len(keys)

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored. Changes nothing."""
        return self.contains_prefix([key]) == 1

    def keys(self) -> list[bytes]:
        """Every stored key, next to evict first (a snapshot of the eviction order, which mirrors the
        database). Changes nothing."""
        with self._write_lock:
            return list(self._lru)

    # ---------------------------------------------------------------- data
    def get(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        """Decode found blocks straight from the map into ``dests`` (no intermediate bytes).

        A batch of at least ``2 * READ_SPLIT_BYTES`` (:mod:`kvstore.tiers.lmdb.reads`) is split into up to ``read_threads`` contiguous
        runs read at once, each in its own read transaction (module docstring, "Cold reads"); the
        caller's thread reads the first. Every returned block passed :func:`decode_into`'s checks
        (header and CRC-32 of the decoded bytes). Marks hits recently used (queued, applied before the
        next eviction). Corrupt values are deleted, counted and announced (see :meth:`Tier.get`). Takes
        the write lock only when a value is corrupt.
        """
        check_buffers(keys, dests, self.layout.bytes_per_block, "disk")
        self._check_open()
        self.last_use = time.monotonic()
        runs = self._split(len(keys))
        futures = [self._readers.submit(self._runs.read, keys, dests, lo, hi) for lo, hi in runs[1:]]
        reads = [self._runs.read(keys, dests, *runs[0])] if runs else []
        reads += [f.result() for f in futures]
        found = [ok for r in reads for ok in r.found]
        corrupt = [key for r in reads for key in r.corrupt]
        if corrupt:
            self._drop_corrupt(corrupt)
        hits = sum(found)
        # Deepest block first: a chain's first blocks become the most recently used (see Tier.get).
        self._hits.extend(key for key, ok in zip(reversed(keys), reversed(found)) if ok)
        with self._read_stats_lock:
            self._stats.hits += hits
            self._stats.misses += len(keys) - hits
            self._stats.read_errors += sum(r.unreadable for r in reads)
            self._stats.bytes_read += hits * self.layout.bytes_per_block
        return found

    def _split(self, n: int) -> list[tuple[int, int]]:
        """The runs of a batch of ``n`` blocks (:func:`split_runs` with ``read_threads``)."""
        return split_runs(n, self.layout.bytes_per_block, self.read_threads)

    def put(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        """Encode and store absent blocks, evicting LRU blocks to stay under the cap.

        Under ``sync: interval`` the blocks are committed in transactions of about :data:`TXN_BYTES`
        each (:meth:`_txn_chunks`); under ``always`` in one transaction, so the batch pays one fsync.
        ``False`` only for a block that cannot fit even in an otherwise empty tier.
        """
        check_buffers(keys, srcs, self.layout.bytes_per_block, "disk")
        with self._write_lock:
            self._check_open()
            self._apply_hits()
            self._touch(reversed(keys))  # a put is a use: present keys must not be this batch's victims
        todo: dict[bytes, EncodedParts] = {}
        for key, src in zip(keys, srcs):
            if key not in self._lru and key not in todo:  # encoding (the checksum) outside the lock lets batches overlap
                todo[key] = encode_parts(src, self.codec, self.codec_level, self._fp, self._itemsize, key=key)
        with self._write_lock:
            self._check_open()
            todo = {k: v for k, v in todo.items() if k not in self._lru}
            stored = sum(self._write(chunk, keep=keys) for chunk in self._txn_chunks(todo))
            present = {k for k in keys if k in self._lru}
        self._handover.run_ready()
        if stored:
            self._note_unsynced(stored)
        return [k in present for k in keys]

    def set_victim_hook(self, hook: VictimHook | None) -> None:
        """Call ``hook`` in the write transaction that evicts, before the deletion (:mod:`kvstore.tiers.victims`).

        Its reader sees that transaction, so the victims (and every other stored block) are read with no
        second transaction. The hook runs under the tier's write lock on the thread that called ``put``;
        its send runs after the commit, outside the write lock."""
        self._handover.hook = hook

    def seed_uses(self, keys: Sequence[bytes], uses: Sequence[int]) -> None:
        """Restart the eviction order's use counts of stored ``keys`` at ``uses`` (see :meth:`Tier.seed_uses`)."""
        with self._write_lock:
            for key, n in zip(keys, uses):
                self._lru.seed(key, n)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove these keys (one write transaction); returns how many were stored."""
        with self._write_lock:
            self._check_open()
            doomed = [k for k in dict.fromkeys(keys) if k in self._lru]
            self._lmdb.txn_or_fail(lambda txn: self._delete_in(txn, doomed))
            for key in doomed:
                self._lru.remove(key)
            return len(doomed)

    def flush(self) -> None:
        """Write pending access times and fsync the environment: every acknowledged put is durable after this."""
        with self._write_lock:
            self._check_open()
            self._apply_hits()
            if self._touched:
                self._lmdb.txn_or_fail(self._write_touches)
        self._lmdb.sync()
        self._unsynced.clear()

    def close(self) -> None:
        """Finish queued async work, flush, stop the threads and close the environment. Idempotent."""
        if self._closing:
            return
        self._pool.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.flush()
        self._closing = True
        self._syncer.stop()
        with self._write_lock:
            if self.capacity is not None:
                self.capacity.leave(self)
            self._lmdb.close()
        self._dirlock.release()

    def stats(self) -> TierStats:
        """Counters: ``used_bytes`` held by blocks (their pages included), ``capacity_bytes`` what blocks may
        use (``max_size`` less the headroom kept for LMDB's own pages), block count."""
        with self._write_lock, self._read_stats_lock:
            self._stats.used_bytes = self._lru.used
            self._stats.capacity_bytes = self._lmdb.budget
            self._stats.num_blocks = len(self._lru)
            return super().stats()

    def map_size(self) -> int:
        """Current LMDB map size in bytes (never above ``max_size``)."""
        return self._lmdb.map_size()

    # ------------------------------------------------------------- private
    def _txn_chunks(self, todo: dict[bytes, EncodedParts]) -> list[dict[bytes, EncodedParts]]:
        """``todo`` cut into the transactions ``put`` commits: whole under ``sync: always`` (one fsync per
        batch), else consecutive runs of at least one block and about :data:`TXN_BYTES` each."""
        if self.sync_mode == "always" or len(todo) < 2:
            return [todo] if todo else []
        chunks: list[dict[bytes, EncodedParts]] = [{}]
        size = 0
        for key, value in todo.items():
            if size >= TXN_BYTES:
                chunks.append({})
                size = 0
            chunks[-1][key] = value
            size += len(value)
        return chunks

    def _write(self, todo: dict[bytes, EncodedParts], keep: Sequence[bytes] = ()) -> int:
        """Store ``todo`` (write lock held), evicting and growing the map as needed; returns bytes stored.

        Each value is assembled in ``_scratch`` (reused, so its pages stay mapped) and copied from there
        by LMDB: joining header and payload into a new object per block cost a page fault per 4 KiB.

        ``keep``: the batch's keys already stored, never its victims (under S3-FIFO a touch does not
        move a key away from the eviction end, so only this protects them). Where sparing them leaves
        no room for all of ``todo`` under the budget, its last blocks are not stored: filling the map
        past the budget would leave no pages for the ``lru`` records that later commits write."""
        budget = self._budget(sum(self._lmdb.cost(len(v)) for v in todo.values()))
        todo = {k: v for k, v in todo.items() if self._lmdb.cost(len(v)) <= budget}
        while todo:
            need = sum(self._lmdb.cost(len(v)) for v in todo.values())
            victims = self._lru.victims(need, budget, exclude=keep)
            freed = sum(self._lru.size_of(k) or 0 for k in victims)
            if self._lru.used - freed + need > budget:  # the batch's own stored blocks are kept: drop its tail
                todo.pop(next(reversed(todo)))
                continue
            sends: list[VictimSend | None] = [None]

            def body(txn: lmdb.Transaction) -> None:
                sends[0] = self._evict_in(txn, victims)  # a retried body (map grown) offers them again
                self._write_touches(txn)
                for key, value in todo.items():
                    self._clock += 1
                    txn.put(key, value.write_into(self._scratch), db=self._blocks)
                    txn.put(key, LRU_RECORD.pack(self._clock, self._lmdb.cost(len(value))), db=self._lru_db)
                txn.put(_CLOCK_KEY, self._clock.to_bytes(8, "little"), db=self._lru_db)

            try:
                self._lmdb.txn(body)
            except lmdb.MapFullError:
                if not self._make_room(keep):
                    todo.pop(next(reversed(todo)))  # the batch alone does not fit: give up its last block
                continue
            self._forget(victims, "evicted")
            self._handover.committed(sends[0])
            for key, value in reversed(todo.items()):  # deepest first (see Tier.put)
                self._lru.add(key, self._lmdb.cost(len(value)))
                self._stats.puts += 1
                self._stats.bytes_written += self.layout.bytes_per_block
            return sum(len(v) for v in todo.values())
        return 0

    def _log_unreadable(self, key: bytes, exc: Exception) -> None:
        self._log.error("unreadable", "block %s in %s/data.mdb is unreadable (%s), served as a miss; %s",
                        short_key(key), self.path, exc, repair_hint(self.path))

    def _log_corrupt(self, exc: CorruptBlock) -> None:
        if isinstance(exc, ValueOutOfBounds):  # a damaged node, not a damaged value: the file needs a look
            self._log.error("out-of-bounds", "dropped a value in %s/data.mdb whose LMDB node is damaged: %s; %s",
                            self.path, exc, repair_hint(self.path))
        else:
            self._log.warning("corrupt", "dropped a corrupt value in %s/data.mdb: %s", self.path, exc)

    def _budget(self, need: int) -> int:
        """What this environment's blocks may occupy for a write of ``need`` bytes: its own budget, or under a
        shared capacity what the others leave of it, after asking them to shed when that is short of
        ``need`` beyond what this tier holds (write lock held). When even all of its own blocks leave too
        little, it waits a bounded time for busy layouts to shed (:meth:`SharedCapacity.reclaim_waiting`):
        a write-behind of acknowledged blocks must not fail because another layout is being flooded."""
        own = self._lmdb.budget
        capacity = self.capacity
        if capacity is None:
            return own
        now = time.monotonic()
        before, self.last_use = self.last_use or now, now  # a tier new to the capacity: anyone idler than now
        left = capacity.limit - capacity.others_used(self)
        if left - self._lru.used < need:  # room from layouts idler than this one, before its own blocks go
            capacity.reclaim(need - (left - self._lru.used), self, idler_than=before)
            left = capacity.limit - capacity.others_used(self)
        if left < need:  # not even all of its own blocks make room: from any other layout
            left = need - capacity.reclaim_waiting(lambda: need - (capacity.limit - capacity.others_used(self)), self)
        return max(0, min(own, left))

    def shed(self, nbytes: int, wait_s: float = 0.0) -> int:
        """Evict the oldest blocks worth at least ``nbytes`` for another tier sharing the capacity, waiting up to
        ``wait_s`` seconds for the write lock (``0``: a tier writing right now sheds nothing; see
        :mod:`kvstore.tiers.shared_capacity` for why a wait cannot deadlock); bytes freed."""
        if self._closing or not self._write_lock.acquire(timeout=wait_s):
            return 0
        try:
            if self._closing:  # closed while this waited
                return 0
            doomed = self._lru.victims(0, max(0, self._lru.used - nbytes))  # in eviction order, until nbytes are free
            freed = sum(self._lru.size_of(k) or 0 for k in doomed)
            if not doomed:
                return 0
            sends: list[VictimSend | None] = [None]

            def body(txn: lmdb.Transaction) -> None:
                sends[0] = self._evict_in(txn, doomed)

            try:
                self._lmdb.txn(body)
            except lmdb.Error:
                return 0
            self._forget(doomed, "evicted")
            self._handover.committed(sends[0])
            return freed
        finally:
            self._write_lock.release()

    def used_bytes(self) -> int:
        """Bytes the blocks occupy (their pages included)."""
        return self._lru.used

    def _make_room(self, keep: Sequence[bytes] = ()) -> bool:
        """The map is full although the estimate fits (fragmented free space, or pages still held for
        readers of the previous snapshot). Evict a quarter of the blocks in small transactions, then
        commit twice more: LMDB reuses pages freed by transaction N only from N+2 on. ``False`` if
        nothing could be evicted. ``keep`` (the batch's stored keys) is spared, as in :meth:`_write`.

        Only tiny maps get here in practice: each commit copies the leaf pages it touches, so a map of
        a few dozen pages with sub-page values spends most of itself on pages awaiting reuse."""
        doomed = self._lru.oldest(max(1, len(self._lru) // 4), exclude=keep)
        if not doomed:
            return False
        for start in range(0, len(doomed), 16):  # small txns: a delete copies the leaf pages it touches
            chunk = doomed[start : start + 16]
            sends: list[VictimSend | None] = [None]

            def body(txn: lmdb.Transaction) -> None:
                sends[0] = self._evict_in(txn, chunk)  # noqa: B023 (runs before chunk changes)

            try:
                self._lmdb.txn(body)
            except lmdb.MapFullError:
                return False  # too full even to copy the leaves a delete touches: refuse the put instead
            self._forget(chunk, "evicted")
            self._handover.committed(sends[0])
        try:
            for _ in range(2):
                self._clock += 1
                self._lmdb.txn(lambda txn: txn.put(_CLOCK_KEY, self._clock.to_bytes(8, "little"), db=self._lru_db))
        except lmdb.MapFullError:
            return False
        return True

    def _apply_hits(self) -> None:
        """Move the keys queued by ``get`` up in the LRU order, in hit order (write lock held). Pops only
        what was queued on entry, so concurrent gets cannot keep the caller here."""
        self._touch(self._hits.popleft() for _ in range(len(self._hits)))

    def _touch(self, keys: Iterable[bytes]) -> None:
        """Mark stored ``keys`` most recently used (write lock held); absent ones (evicted, deleted) are skipped."""
        for key in keys:
            if self._lru.touch(key):
                self._clock += 1
                self._touched[key] = self._clock

    def _forget(self, keys: Sequence[bytes], kind: str) -> None:
        for key in keys:
            self._lru.remove(key)
            if kind == "evicted":
                self._stats.evictions += 1
            else:
                self._stats.corrupt_dropped += 1
            self._emit(kind, key)

    def _evict_in(self, txn: lmdb.Transaction, victims: Sequence[bytes]) -> VictimSend | None:
        """Offer ``victims`` to the victim hook with a reader on ``txn``, then delete them in it; the hook's send."""
        send = None
        if victims:
            reader = txn_reader(txn, self._blocks, self._fp, self.layout.bytes_per_block, self._lmdb.window(self._max_value))
            send = self._handover.offer(victims, reader)
        self._delete_in(txn, victims)
        return send

    def _delete_in(self, txn: lmdb.Transaction, keys: Sequence[bytes]) -> None:
        for key in keys:
            txn.delete(key, db=self._blocks)
            txn.delete(key, db=self._lru_db)
            self._touched.pop(key, None)

    def _write_touches(self, txn: lmdb.Transaction) -> None:
        for key, clock in self._touched.items():
            size = self._lru.size_of(key)
            if size is not None:
                txn.put(key, LRU_RECORD.pack(clock, size), db=self._lru_db)
        self._touched.clear()

    def _drop_corrupt(self, keys: list[bytes]) -> None:
        """Delete values that failed verification; if even that fails (damaged pages), they stay stored but
        are still counted and announced: every read of them is a miss either way."""
        with self._write_lock:
            try:
                self._lmdb.txn_or_fail(lambda txn: self._delete_in(txn, keys))
            except TierError as exc:
                self._log.error("drop-failed", "could not delete %d corrupt values: %s", len(keys), exc)
            self._forget(keys, "corrupt")

    def _load_lru(self) -> None:
        """Order the stored blocks by their recorded access counters (:meth:`LmdbEnv.access_records`).

        Restored with ``add_oldest`` (blocks with a history): LRU order as recorded; under ``s3fifo`` every
        block goes to the main queue in access order with frequency 0, under ``gdsf`` at count 1 and
        priority ``L`` in access order (frequencies and counts are not persisted)."""
        records, orphans = self._lmdb.access_records(self._blocks, self._lru_db, self._max_value)
        for clock, block_key, cost in reversed(records):  # newest first, each before the rest: oldest ends first
            self._lru.add_oldest(block_key, cost)
            self._clock = max(self._clock, clock)
        for block_key, cost in orphans:
            self._lru.add_oldest(block_key, cost)

    def _note_unsynced(self, nbytes: int) -> None:
        if self.sync_mode == "interval" and self._unsynced.add(nbytes) >= self.sync_bytes:
            self._syncer.kick()

    def _background(self) -> None:
        """The sync thread's work: persist access times, and under ``interval`` fsync pending commits."""
        pending = self._unsynced.pending()
        if self._touched or self._hits:
            with self._write_lock:
                if self._closing:
                    return
                self._apply_hits()
                try:
                    self._lmdb.txn(self._write_touches)
                except lmdb.MapFullError:
                    pass  # recency only; the next put (which makes room) writes it
        if pending:
            self._lmdb.sync()
            self._unsynced.synced(pending)

    def _check_open(self) -> None:
        if self._closing:
            raise TierError(f"disk tier at {self.path} is closed")
