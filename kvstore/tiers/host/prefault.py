"""Map a host arena's pages in the background, so a put into a fresh slot does not take a fault per 4 KiB.

A new arena (private memory or a POSIX shared segment) has no pages yet: the
first write to each 4 KiB page traps into the kernel, which allocates and
zeroes it. A process that attaches another's segment faults again, once per
page, to map it. Measured through the daemon on this VM (2026-12-02, 2
clients, 64 KiB blocks into never-used slots): the clients' copies into the
segment took about 60 % of a put; with both mappings populated beforehand
the puts took 0.17-0.18 s per 128 MiB instead of 0.27. A pinned arena
(``cudaHostRegister``) is populated by the registration, as every GPU
server's host buffer is at start.

:class:`Prefaulter` asks the kernel to populate the range in chunks of
:data:`CHUNK_BYTES` with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+),
from a daemon thread, so the tier serves at once while its pages are
mapped. The call never changes the memory's contents (safe on a segment
other processes are writing), and it runs outside the GIL (``ctypes``).
On a kernel without it the thread stops after the first chunk and logs
why; nothing else changes. :meth:`Prefaulter.stop` ends it between chunks;
the owner calls it before unmapping.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
"""Linux's advice number (include/uapi/asm-generic/mman-common.h), not exported by Python 3.11's ``mmap``."""
CHUNK_BYTES = 64 << 20
"""Bytes populated per ``madvise`` call: small enough that :meth:`Prefaulter.stop` waits at most one chunk."""

Madvise = Callable[[int, int, int], int]
"""``madvise(address, length, advice)``: 0, or -1 with ``ctypes.get_errno()`` set."""


def libc_madvise() -> Madvise:
    """The C library's ``madvise`` through ``ctypes`` (which releases the GIL around the call)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class Prefaulter:
    """Populates ``[address, address + nbytes)`` writable on a daemon thread, one chunk at a time."""

    def __init__(self, address: int, nbytes: int, name: str, madvise: Madvise | None = None) -> None:
        """Start at once. ``name`` says whose memory it is in the log; ``madvise`` replaces libc's (tests)."""
        self.address, self.nbytes, self.name = address, nbytes, name
        self._madvise = madvise or libc_madvise()
        self._stop = threading.Event()
        self.done = threading.Event()
        """Set when the thread has ended (whole range populated, stopped, or refused by the kernel)."""
        self.populated = 0
        """Bytes populated so far."""
        self.error = ""
        """Why it stopped early (empty unless it did)."""
        self._thread = threading.Thread(target=self._run, name="kvstore-prefault", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop between chunks and wait for the thread (at most one chunk). Idempotent."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            start = self.address - self.address % page
            end = self.address + self.nbytes
            while start < end and not self._stop.is_set():
                length = min(CHUNK_BYTES, end - start)
                if self._madvise(start, length, MADV_POPULATE_WRITE) != 0:
                    code = ctypes.get_errno()
                    self.error = f"madvise(MADV_POPULATE_WRITE) failed: {os.strerror(code) if code else 'unknown error'}"
                    level = logging.INFO if code in (errno.EINVAL, errno.ENOSYS) else logging.WARNING
                    log.log(level, "%s: pages not mapped ahead (%s; Linux 5.14+ has it); the first put into each "
                            "slot maps its pages instead", self.name, self.error)
                    return
                start += length
                self.populated = min(self.nbytes, start - self.address)
            if not self._stop.is_set():
                log.debug("%s: %d bytes of pages mapped ahead", self.name, self.nbytes)
        finally:
            self.done.set()
