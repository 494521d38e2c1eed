"""File tier: one file per block, the baseline LMCache and SGLang use, kept to benchmark LMDB against.

::

    <root>/<first 2 hex of key>/<64 hex key>.kvb     codec header + payload (see kvstore.tiers.codec)
    <root>/<..>/<64 hex key>.<random>.tmp            a write in progress

A block is written to a temporary file, fsynced, then renamed over its real
name (``os.replace`` is atomic), so a crash leaves at most a ``.tmp`` file,
never a partial block under a real name; ``.tmp`` files are removed on open.
The file system is the source of truth (content-addressed); one process at a
time holds the directory (an exclusive lock on ``<root>/kvstore.lock``, see
:mod:`kvstore.tiers.datadir`: a second one is refused with the holder's pid,
since two eviction orders over one tree would each miscount the cap). The
root and its subdirectories are 0700, block files 0600. The eviction order (the placement policy's,
:mod:`kvstore.policy.order`) is kept in memory, seeded from file
modification times on open and refreshed with ``utime`` on every hit, so a
restart evicts the coldest files first. The cap counts file sizes
rounded up to 4 KiB blocks.

I/O runs with aiofiles on one event loop in a background thread (started
once; a per-batch ``asyncio.run`` would create a loop and executor per call),
so synchronous callers just wait on the batch's future.

Victims: an owner may see every capacity eviction before the files go
(:meth:`FileTier.set_victim_hook`, :mod:`kvstore.tiers.victims`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiofiles
import aiofiles.os

from kvstore.tiers.codec import CODECS, decode_into, encode
from kvstore.config.schema import FileConfig
from kvstore.errors import CorruptBlock, TierError
from kvstore.layout import KVLayout
from kvstore.util.ratelog import RateLimitedLog
from kvstore.tiers.base import Buffer, PooledTier, TierStats, VictimHook, check_buffers
from kvstore.tiers.datadir import DIR_MODE, FILE_MODE, DirLock, make_private_dir, narrow
from kvstore.policy.order import EvictionOrder, order_for
from kvstore.tiers.victims import Handover

log = logging.getLogger(__name__)
_FS_BLOCK = 4096
T = TypeVar("T")


def _private_opener(path: str, flags: int) -> int:
    """``open`` hook: new block files are created 0600, never readable by other users for an instant."""
    return os.open(path, flags, FILE_MODE)


def _footprint(nbytes: int) -> int:
    return -(-nbytes // _FS_BLOCK) * _FS_BLOCK


class FileTier(PooledTier):
    """Blocks as files under ``path``, at most ``max_size`` bytes (rounded to 4 KiB per file)."""

    name = "file"
    takes_victim_hook = True

    def __init__(
        self,
        layout: KVLayout,
        path: str | os.PathLike[str],
        max_size: int,
        *,
        codec: str = "none",
        codec_level: int = 1,
        io_threads: int = 2,
        order: EvictionOrder | None = None,
    ) -> None:
        """Scan ``path`` (creating it), delete leftover ``.tmp`` files, and start the event-loop thread.

        ``order``: the empty eviction order the placement policy built for this tier
        (:meth:`~kvstore.policy.named.PlacementPolicy.orders`; ``None``: LRU). See :meth:`_scan` for reopen.
        """
        super().__init__(layout)
        CODECS.get(codec)
        self.root = os.fspath(path)
        self.max_size = max_size
        self.codec, self.codec_level = codec, codec_level
        self._fp, self._itemsize = layout.fingerprint, layout.itemsize
        self._lock = threading.Lock()
        self._log = RateLimitedLog(log)  # corrupt files: once per interval, not per block
        self._lru = order_for(order)
        self._handover = Handover(self.name)  # the victim hook (set_victim_hook) and its pending sends
        make_private_dir(self.root)
        self._dirlock = DirLock(self.root, "file.path")
        try:
            self.tmp_removed = self._scan()
        except BaseException:
            self._dirlock.release()
            raise
        """How many leftover ``.tmp`` files the open removed (crash debris)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-file-io", daemon=True)
        self._thread.start()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-file")
        self._closed = False

    @classmethod
    def from_config(cls, section: FileConfig, layout: KVLayout, *, order: EvictionOrder | None = None) -> FileTier:
        """Build from the ``file`` section of the config (``order``: see :meth:`__init__`)."""
        return cls(
            layout, section.directory(), int(section.max_size), codec=section.codec, codec_level=section.codec_level,
            order=order,
        )

    def path_of(self, key: bytes) -> str:
        """The file that holds ``key``."""
        name = key.hex()
        return os.path.join(self.root, name[:2], name + ".kvb")

    # ------------------------------------------------------------- queries
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, have a file. Changes nothing."""
        for n, key in enumerate(keys):
            if not os.path.exists(self.path_of(key)):
                return n
        return len(keys)

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` has a file. Changes nothing."""
        return os.path.exists(self.path_of(key))

    def keys(self) -> list[bytes]:
        """Every key the tier accounts for, next to evict first (a snapshot). Changes nothing."""
        with self._lock:
            return list(self._lru)

    # ---------------------------------------------------------------- data
    def get(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        """Read and verify each block's file into its destination; hits become most recently used (and get a new mtime)."""
        check_buffers(keys, dests, self.layout.bytes_per_block, "file")
        found = self._run(self._read_all(keys, dests))
        corrupt = [key for key, ok in zip(keys, found) if isinstance(ok, CorruptBlock)]
        for exc in (ok for ok in found if isinstance(ok, CorruptBlock)):
            self._log.warning("corrupt", "dropped a corrupt block file under %s: %s", self.root, exc)
        if corrupt:
            self.delete(corrupt)
        with self._lock:
            for key, ok in zip(reversed(keys), reversed(found)):  # deepest first (see Tier.get)
                if isinstance(ok, CorruptBlock):
                    self._stats.corrupt_dropped += 1
                    self._emit("corrupt", key)
                elif ok:
                    # A block evicted by a concurrent put after it was read and verified is not touched back
                    # into the order (its file is gone; the bytes read are whole and checked, so still a hit).
                    self._lru.touch(key)
            hits = sum(ok is True for ok in found)
            self._stats.hits += hits
            self._stats.misses += len(keys) - hits
            self._stats.bytes_read += hits * self.layout.bytes_per_block
        return [ok is True for ok in found]

    def put(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        """Write absent blocks (tmp + fsync + rename), evicting the LRU files first to stay under the cap."""
        check_buffers(keys, srcs, self.layout.bytes_per_block, "file")
        todo: dict[bytes, bytes] = {}
        for key, src in zip(keys, srcs):
            if key not in todo and not self.contains(key):
                todo[key] = encode(src, self.codec, self.codec_level, self._fp, self._itemsize, key=key)
        with self._lock:
            self._check_open()
            for key in reversed(keys):
                self._lru.touch(key)  # a put is a use; deepest first (see Tier.put)
            todo = {k: v for k, v in todo.items() if _footprint(len(v)) <= self.max_size}
            need = sum(_footprint(len(v)) for v in todo.values())
            victims = self._lru.victims(need, self.max_size, exclude=keys)
            for key in victims:
                self._lru.remove(key)
                self._stats.evictions += 1
                self._emit("evicted", key)
            for key, value in reversed(todo.items()):  # accounted before writing (cap); deepest first
                self._lru.add(key, _footprint(len(value)))
        send = self._handover.offer(victims, self._read_quietly) if victims else None
        self._run(self._unlink_all(victims))
        self._handover.committed(send)
        self._handover.run_ready()
        written = self._run(self._write_all(todo))
        with self._lock:
            for key, ok in written.items():
                if ok:
                    self._stats.puts += 1
                    self._stats.bytes_written += self.layout.bytes_per_block
                else:
                    self._lru.remove(key)
        return [self.contains(key) for key in keys]

    def set_victim_hook(self, hook: VictimHook | None) -> None:
        """Call ``hook`` with each put's victims before their files are unlinked (:mod:`kvstore.tiers.victims`).

        They are out of the eviction order already (the cap counts them gone); the hook reads their files on
        the thread that called ``put``, outside the tier's lock, and its send runs once they are unlinked."""
        self._handover.hook = hook

    def _read_quietly(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        """Read and verify files into ``dests`` without counting or recency (a victim hook's reader)."""
        check_buffers(keys, dests, self.layout.bytes_per_block, "file")
        return [ok is True for ok in self._run(self._read_all(keys, dests, touch=False))]

    def seed_uses(self, keys: Sequence[bytes], uses: Sequence[int]) -> None:
        """Restart the eviction order's use counts of stored ``keys`` at ``uses`` (see :meth:`Tier.seed_uses`)."""
        with self._lock:
            for key, n in zip(keys, uses):
                self._lru.seed(key, n)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the files of these keys; returns how many existed."""
        with self._lock:
            for key in keys:
                self._lru.remove(key)
        return sum(self._run(self._unlink_all(list(dict.fromkeys(keys)))))

    def close(self) -> None:
        """Finish queued async work and stop the event loop (every put was fsynced already). Idempotent."""
        if self._closed:
            return
        self._pool.shutdown(wait=True)
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._dirlock.release()

    def stats(self) -> TierStats:
        """Counters, with accounted bytes, capacity and file count."""
        with self._lock:
            self._stats.used_bytes, self._stats.num_blocks = self._lru.used, len(self._lru)
            self._stats.capacity_bytes = self.max_size
            return super().stats()

    # ------------------------------------------------------------- private
    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        self._check_open()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise TierError(f"file tier at {self.root} is closed")

    async def _read_all(self, keys: Sequence[bytes], dests: Sequence[Buffer],
                        touch: bool = True) -> list[bool | CorruptBlock]:
        return list(await asyncio.gather(*(self._read(k, d, touch) for k, d in zip(keys, dests))))

    async def _read(self, key: bytes, dest: Buffer, touch: bool = True) -> bool | CorruptBlock:
        """``True`` filled, ``False`` absent, the error if corrupt; ``touch``: refresh the mtime (recency) of a hit."""
        path = self.path_of(key)
        try:
            async with aiofiles.open(path, "rb") as f:
                value = await f.read()
        except FileNotFoundError:
            return False
        try:
            decode_into(value, dest, self._fp, key)
        except CorruptBlock as exc:
            return exc
        if not touch:
            return True
        try:
            await aiofiles.os.wrap(os.utime)(path)  # recency that survives a restart
        except FileNotFoundError:
            pass  # evicted meanwhile; the bytes we read were verified
        return True

    async def _write_all(self, todo: dict[bytes, bytes]) -> dict[bytes, bool]:
        results = await asyncio.gather(*(self._write(k, v) for k, v in todo.items()))
        return dict(zip(todo, results))

    async def _write(self, key: bytes, value: bytes) -> bool:
        path = self.path_of(key)
        await aiofiles.os.makedirs(os.path.dirname(path), mode=DIR_MODE, exist_ok=True)
        tmp = f"{path[:-4]}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            async with aiofiles.open(tmp, "wb", opener=_private_opener) as f:
                await f.write(value)
                await f.flush()
                await aiofiles.os.wrap(os.fsync)(f.fileno())
            await aiofiles.os.replace(tmp, path)
        except OSError:  # disk full, permissions: the block is simply not stored
            if os.path.exists(tmp):
                os.unlink(tmp)
            return False
        return True

    async def _unlink_all(self, keys: Sequence[bytes]) -> list[bool]:
        async def one(key: bytes) -> bool:
            try:
                await aiofiles.os.remove(self.path_of(key))
                return True
            except FileNotFoundError:
                return False

        return list(await asyncio.gather(*(one(k) for k in keys)))

    def _scan(self) -> int:
        """Seed the eviction order from existing files by mtime; remove ``.tmp`` debris. Returns the debris count.

        Restored with ``add_oldest``, newest first, so the oldest mtime is evicted first; under ``s3fifo``
        every file goes to the main queue (it has a history), in mtime order."""
        found: list[tuple[float, bytes, int]] = []
        removed = 0
        for sub in os.scandir(self.root):
            if not sub.is_dir():
                continue
            narrow(sub.path, DIR_MODE)  # an older build made them 0755
            for entry in os.scandir(sub.path):
                if entry.name.endswith(".tmp"):
                    os.unlink(entry.path)
                    removed += 1
                elif entry.name.endswith(".kvb") and len(entry.name) == 68:
                    st = entry.stat()
                    if st.st_mode & 0o077:
                        os.chmod(entry.path, FILE_MODE)
                    found.append((st.st_mtime, bytes.fromhex(entry.name[:64]), _footprint(st.st_size)))
        for _, key, size in sorted(found, reverse=True):
            self._lru.add_oldest(key, size)
        return removed
