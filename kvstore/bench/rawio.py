"""The machine's own limits: memcpy bandwidth and raw direct I/O on a disk, one request and many in flight.

``kvstore plan`` measures them when not given bandwidths, and they are the
denominators of the ``tiers`` suite, measured in the same run as the tiers
themselves:

- memcpy: a copy of the same bytes between two preallocated buffers (a
  ``memmove`` through ``memoryview``, so measuring it needs no torch);
- per-block memcpy: the same bytes copied one ``memmove`` per block (what a
  block store must do: its blocks are not one range). glibc copies a range
  above about 3/4 of the last-level cache with non-temporal stores, which skip
  reading the destination into the cache first; block-sized copies are far
  below that threshold, so at every block size this limit is lower than the
  single copy (0.5-0.65 of it on the loaded 2-core VM, 2026-12-01);
- direct I/O: ``O_DIRECT`` sequential write then read of a file of the same
  total size in the same directory as the tier's data, through page-aligned
  buffers from anonymous ``mmap``. If the filesystem refuses ``O_DIRECT``
  (tmpfs, some overlays) it falls back to buffered I/O with ``fsync`` and
  ``posix_fadvise(DONTNEED)`` before the read, and says so in ``mode``;
- parallel direct read: the same file read again by several threads, each
  ``pread``-ing requests of a given size (the tier's block size) from one
  shared ``O_DIRECT`` descriptor, so several requests are in flight at once.
  A single thread of sequential requests leaves an NVMe or virtio queue
  mostly idle; this is the disk's read limit a batched reader can approach.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CHUNK = 16 << 20
"""I/O request size for the raw disk limit (16 MiB: smaller requests leave a single-threaded reader short of the device bandwidth)."""


def memcpy_gbps(nbytes: int, repeat: int = 5) -> float:
    """Best bandwidth of copying ``nbytes`` between two preallocated buffers, in GB/s (1e9 B/s)."""
    src = memoryview(bytearray(os.urandom(min(nbytes, 1 << 20)) * -(-nbytes // (1 << 20))))[:nbytes]
    dst = memoryview(bytearray(nbytes))
    dst[:] = src  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst[:] = src
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def memcpy_per_block_gbps(nbytes: int, block_bytes: int, repeat: int = 5) -> float:
    """Best bandwidth of copying ``nbytes`` as ``block_bytes`` pieces (one ``memmove`` each), in GB/s."""
    n = max(1, nbytes // block_bytes)
    src = bytearray(os.urandom(min(n * block_bytes, 1 << 20)) * -(-(n * block_bytes) // (1 << 20)))
    dst = bytearray(len(src))
    s = ctypes.addressof((ctypes.c_char * len(src)).from_buffer(src))
    d = ctypes.addressof((ctypes.c_char * len(dst)).from_buffer(dst))
    best = float("inf")
    for _ in range(repeat + 1):  # the first pass faults the destination pages in
        t0 = time.perf_counter()
        for i in range(n):
            ctypes.memmove(d + i * block_bytes, s + i * block_bytes, block_bytes)
        best = min(best, time.perf_counter() - t0)
    return n * block_bytes / best / 1e9


@dataclass(frozen=True)
class DirectIO:
    """Raw sequential disk bandwidth in GB/s and how it was measured."""

    write_gbps: float
    read_gbps: float
    mode: str
    """``"O_DIRECT"`` or ``"buffered+fsync+fadvise"`` (O_DIRECT refused)."""
    parallel_read_gbps: float | None = None
    """Best read bandwidth with several requests in flight (``None``: not measured)."""
    parallel_threads: int | None = None
    """Threads of the best parallel read."""
    parallel_request: int | None = None
    """Bytes per request of the parallel read."""


def drop_page_cache() -> bool:
    """``sync`` then write 3 to ``/proc/sys/vm/drop_caches``; ``True`` when it worked (needs root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def evict_file(path: Path) -> None:
    """Ask the kernel to drop ``path``'s cached pages (``posix_fadvise(DONTNEED)`` after ``fsync``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _open_direct(path: Path, flags: int) -> tuple[int, bool]:
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600), True
        except OSError:
            pass
    return os.open(path, flags, 0o600), False


RAW_FILE = "rawio.bench"
"""The file :func:`direct_io_gbps` writes in the directory under test (kept with ``keep=True``)."""


def direct_io_gbps(directory: Path, nbytes: int, parallel_request: int | None = None,
                   parallel_threads: Sequence[int] = (4, 8), keep: bool = False) -> DirectIO:
    """Write then read ``nbytes`` (rounded up to :data:`CHUNK`) sequentially in ``directory``; removes the file
    unless ``keep`` (then it stays as ``directory / RAW_FILE`` for :func:`best_parallel_read`).

    With ``parallel_request`` the file is then read again once per entry of ``parallel_threads``
    (:func:`parallel_read_gbps`); the best of those is the parallel read limit."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RAW_FILE
    chunks = max(1, -(-nbytes // CHUNK))
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT requires
    buf.write(os.urandom(CHUNK))
    try:
        fd, direct = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        t_write = _timed_write(fd, buf, chunks)
        if not direct:
            evict_file(path)
        fd, direct_read = _open_direct(path, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            for _ in range(chunks):
                if os.readv(fd, [buf]) < CHUNK:
                    raise OSError(f"short read from {path}")
            t_read = time.perf_counter() - t0
        finally:
            os.close(fd)
        total = chunks * CHUNK
        best = best_parallel_read(path, total, parallel_request, parallel_threads) if parallel_request else None
    finally:
        buf.close()
        if not keep:
            path.unlink(missing_ok=True)
    mode = "O_DIRECT" if direct and direct_read else "buffered+fsync+fadvise"
    return DirectIO(total / t_write / 1e9, total / t_read / 1e9, mode, best and best[0], best and best[1],
                    _pages(parallel_request) if best and parallel_request else None)


def buffered_write_gbps(path: Path, nbytes: int) -> float:
    """Write a new file of ``nbytes`` (rounded up to :data:`CHUNK`) through the page cache, then ``fsync``;
    GB/s. The file is kept (removing it would hand its page-cache pages straight to the next writer).

    The limit of a writer that goes through the page cache, as LMDB does: on this Firecracker VM each new
    page-cache page can cost a host fault (guest memory the balloon's free page reporting gave back), so
    this runs 0.1-1.5 GB/s depending on what the guest freed just before, while ``O_DIRECT`` does not vary."""
    chunks = max(1, -(-nbytes // CHUNK))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    return chunks * CHUNK / _timed_write(fd, os.urandom(CHUNK), chunks) / 1e9


def _timed_write(fd: int, data: bytes | mmap.mmap, chunks: int) -> float:
    """Seconds to write ``data`` ``chunks`` times to ``fd`` and ``fsync`` it; closes ``fd``."""
    try:
        t0 = time.perf_counter()
        for _ in range(chunks):
            os.write(fd, data)
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (at least one), as ``O_DIRECT`` requests must be."""
    return max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)


def best_parallel_read(path: Path, nbytes: int, request: int, threads: Sequence[int]) -> tuple[float, int]:
    """:func:`parallel_read_gbps` once per entry of ``threads``; the best GB/s and its thread count."""
    return max((parallel_read_gbps(path, nbytes, request, t), t) for t in threads)


def parallel_read_gbps(path: Path, nbytes: int, request: int, threads: int) -> float:
    """Read the first ``nbytes`` of ``path`` in ``request``-byte ``pread`` calls (rounded up to the page
    size, as ``O_DIRECT`` requires) spread round-robin over ``threads`` threads sharing one ``O_DIRECT``
    descriptor; GB/s. Without ``O_DIRECT`` the file's cached pages are dropped first. Changes nothing."""
    request = _pages(request)
    count = max(1, nbytes // request)
    fd, direct = _open_direct(path, os.O_RDONLY)
    try:
        if not direct:
            evict_file(path)

        def reader(first: int) -> None:
            buf = mmap.mmap(-1, request)  # page-aligned, one per thread
            try:
                for i in range(first, count, threads):
                    if os.preadv(fd, [buf], i * request) < request:
                        raise OSError(f"short read from {path} at {i * request}")
            finally:
                buf.close()

        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            for f in [pool.submit(reader, t) for t in range(threads)]:
                f.result()
            elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
    return count * request / elapsed / 1e9
