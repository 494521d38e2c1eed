"""Layouts whose disk data stays while no shelf is open for them, counted against the shared disk budget.

A daemon serving any layout opens a layout's tiers when its first client comes and closes them when it must
make room (``daemon.max_layouts``) or at a restart; the layout's LMDB directory stays, to be found again. Those
bytes are on the disk all the same, so ``disk.max_size`` counts them: each dormant directory joins the shared
disk budget (:mod:`kvstore.tiers.shared_capacity`) at its file's size, as the least recently used of all,
and when an open layout needs room the budget takes it from dormant directories first, a whole directory at a
time (it cannot evict single blocks without opening the environment; it is the coldest data on the disk).
A layout whose client returns is woken first: taken off the budget, then opened, its own tier counting its
blocks from then on. Nothing here imports torch (an idle daemon stays small).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading

from kvstore.daemon.server.layout_dirs import layout_label
from kvstore.layout import KVLayout
from kvstore.tiers.shared_capacity import SharedCapacity

log = logging.getLogger(__name__)
DATA_FILE = "data.mdb"


class DormantDir:
    """One closed layout's directory as the shared disk budget sees it (:class:`~kvstore.tiers.shared_capacity.Shedding`)."""

    last_use = 0.0
    """Idler than any open tier: a dormant directory gives way first."""

    def __init__(self, layout: KVLayout, directory: str) -> None:
        self.layout, self.directory = layout, directory
        self._lock = threading.Lock()
        self._size = _data_bytes(directory)
        self.gone = False
        """Shed (its directory removed) or woken (its layout open again): it holds nothing of the budget's."""

    def used_bytes(self) -> int:
        """Bytes of its LMDB file (whole: LMDB never gives pages back to the file system)."""
        return 0 if self.gone else self._size

    def shed(self, nbytes: int, wait_s: float = 0.0) -> int:
        """Remove the whole directory for another layout's room (unless woken meanwhile); bytes freed."""
        acquired = self._lock.acquire(timeout=wait_s) if wait_s > 0 else self._lock.acquire(blocking=False)
        if not acquired:
            return 0
        try:
            if self.gone:
                return 0
            shutil.rmtree(self.directory, ignore_errors=True)
            self.gone = True
            log.info("layout %s had no client: its %d bytes of disk data removed to make room for another layout",
                     layout_label(self.layout), self._size)
            return self._size
        finally:
            self._lock.release()

    def wake(self) -> None:
        """Its layout opens again: from now on its own tier counts its blocks (waits for a shed under way)."""
        with self._lock:
            self.gone = True


class DormantLayouts:
    """The dormant directories of a daemon serving any layout, in its shared disk budget (``None``: no lmdb tier)."""

    def __init__(self, capacity: SharedCapacity | None) -> None:
        self._capacity = capacity
        self._by_fingerprint: dict[bytes, DormantDir] = {}
        self._lock = threading.Lock()

    def add(self, layout: KVLayout, directory: str) -> None:
        """``layout``'s tiers closed (or were never opened since start) with data in ``directory``."""
        if self._capacity is None or not os.path.isdir(directory):
            return
        dormant = DormantDir(layout, directory)
        with self._lock:
            self._by_fingerprint[layout.fingerprint] = dormant
        self._capacity.join(dormant)

    def wake(self, layout: KVLayout) -> None:
        """``layout`` is about to open: take its directory off the budget (its tier will count it)."""
        with self._lock:
            dormant = self._by_fingerprint.pop(layout.fingerprint, None)
        if dormant is not None and self._capacity is not None:
            dormant.wake()
            self._capacity.leave(dormant)

    def __len__(self) -> int:
        with self._lock:
            return sum(not d.gone for d in self._by_fingerprint.values())

    def used_bytes(self) -> int:
        """Bytes the dormant directories hold now."""
        with self._lock:
            return sum(d.used_bytes() for d in self._by_fingerprint.values())


def _data_bytes(directory: str) -> int:
    """Size of the LMDB data file in ``directory`` (0 if there is none)."""
    try:
        return os.path.getsize(os.path.join(directory, DATA_FILE))
    except OSError:
        return 0
