"""The slab tier's data file: fixed-size, 4 KiB-aligned slots written and read with ``O_DIRECT``.

::

    slot:   0          1          2                      slot_bytes = value length rounded up to 4 KiB
    file:   |value|pad |value|pad |value|pad | ...       slot i at offset i * slot_bytes

A write or read of consecutive slots is one request, staged in a page-aligned buffer (anonymous
``mmap``, as ``O_DIRECT`` requires). The file is grown with ``posix_fallocate``, doubling but by at most
``grow_step`` at a time, never past ``slots`` slots. Where the file system refuses ``O_DIRECT`` (tmpfs) the file is opened buffered and
:attr:`SlotFile.direct` is ``False``; every read is still verified by the caller.

This module knows offsets and bytes only; which key owns which slot is the index's business
(:mod:`kvstore.tiers.slab.tier`).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.errors import TierError
from kvstore.tiers.datadir import FILE_MODE, narrow

ALIGN = 4096
"""Slot and request alignment (the logical block size ``O_DIRECT`` needs on NVMe and ext4)."""
MAX_REQUEST = 8 << 20
"""Most bytes one pwrite or pread moves: larger runs are split (staging buffers stay small)."""


def slot_bytes(value_len: int) -> int:
    """Bytes of one slot holding a value of ``value_len`` bytes (rounded up to :data:`ALIGN`)."""
    return -(-value_len // ALIGN) * ALIGN


@dataclass(frozen=True)
class Run:
    """Consecutive slots ``first .. first + len(items) - 1``; ``items[j]`` is the batch position of slot ``first + j``."""

    first: int
    items: tuple[int, ...]


def runs(slots: Sequence[int], max_slots: int) -> list[Run]:
    """Group batch positions by consecutive slot numbers, at most ``max_slots`` slots per run. Changes nothing.

    ``slots[i]`` is the slot of batch position ``i``; the runs come in slot order.
    """
    order = sorted(range(len(slots)), key=slots.__getitem__)
    out: list[Run] = []
    cur: list[int] = []
    for i in order:
        if cur and (slots[i] != slots[cur[-1]] + 1 or len(cur) == max_slots):
            out.append(Run(slots[cur[0]], tuple(cur)))
            cur = []
        cur.append(i)
    if cur:
        out.append(Run(slots[cur[0]], tuple(cur)))
    return out


class SlotFile:
    """The data file at ``path``: ``slots`` slots of ``slot_size`` bytes, grown by at most ``grow_step`` bytes at a time."""

    def __init__(self, path: str, slot_size: int, slots: int, grow_step: int, *, direct: bool = True) -> None:
        """Open (creating 0600) the file; ``direct=False`` or a file system without ``O_DIRECT``: buffered I/O."""
        if slot_size % ALIGN:
            raise ValueError(f"slot size {slot_size} is not a multiple of {ALIGN}")
        self.path, self.slot_size, self.slots = path, slot_size, slots
        self._step = max(1, grow_step // slot_size)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        self.fd, self.direct = -1, False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd, self.direct = os.open(path, flags | os.O_DIRECT, FILE_MODE), True
            except OSError:
                pass  # EINVAL: no O_DIRECT here (tmpfs); fall through to buffered
        try:
            if self.fd < 0:
                self.fd = os.open(path, flags, FILE_MODE)
        except OSError as exc:
            raise TierError(f"slab data file {path} cannot be opened ({exc.strerror or exc}); "
                            "make slab.path and its files writable by this user") from None
        narrow(path, FILE_MODE)
        self.allocated = os.fstat(self.fd).st_size // slot_size
        """Slots the file covers now (a truncated file covers fewer than the index may refer to)."""
        self._local = threading.local()  # one staging buffer per thread (reads run on several)

    def buffer(self, nbytes: int) -> mmap.mmap:
        """This thread's page-aligned staging buffer of at least ``nbytes`` (reused; grown when too small)."""
        buf: mmap.mmap | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:  # the old one is freed once no view of it is left
            buf = self._local.buf = mmap.mmap(-1, max(nbytes, MAX_REQUEST))
        return buf

    def ensure(self, slot: int) -> None:
        """Preallocate the file through ``slot`` (doubling, by at most ``grow_step``, never past ``slots``)."""
        if slot < self.allocated:
            return
        # Doubling up to a step: a small tier does not preallocate a whole step on its first put.
        target = min(self.slots, max(slot + 1, self.allocated + min(self._step, max(self.allocated, 1))))
        try:
            os.posix_fallocate(self.fd, 0, target * self.slot_size)
        except OSError as exc:
            raise TierError(f"cannot grow slab data file {self.path} to {target * self.slot_size} bytes: "
                            f"{exc.strerror or exc}") from None
        self.allocated = target

    def write(self, first: int, data: memoryview) -> None:
        """Write ``data`` (whole slots, from an aligned buffer) at slot ``first``; :class:`TierError` on failure."""
        self.ensure(first + len(data) // self.slot_size - 1)
        off, done = first * self.slot_size, 0
        try:
            while done < len(data):
                done += os.pwrite(self.fd, data[done:], off + done)
        except OSError as exc:
            raise TierError(f"write to slab data file {self.path} failed: {exc.strerror or exc}") from None

    def read(self, first: int, count: int) -> memoryview:
        """Read slots ``first .. first + count - 1`` into this thread's buffer; the view may be short (file end)."""
        want = count * self.slot_size
        buf = self.buffer(want)
        view = memoryview(buf)
        off, done = first * self.slot_size, 0
        while done < want:
            n = os.preadv(self.fd, [view[done:want]], off + done)
            if n == 0:
                break
            done += n
        return view[:done]

    def sync(self) -> None:
        """``fdatasync`` the data file: every slot written so far is on the device."""
        try:
            os.fdatasync(self.fd)
        except OSError as exc:
            raise TierError(f"sync of slab data file {self.path} failed: {exc.strerror or exc}") from None

    def close(self) -> None:
        """Close the descriptor. Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` pieces of ``range(n)`` of at most ``size`` each."""
    for lo in range(0, n, size):
        yield lo, min(n, lo + size)
