"""The disk tier's LMDB environment: opened safely, grown in steps up to its cap, every error a TierError.

::

    data.mdb   the map: starts at ``map_step`` (or the file's size), grows by ``map_step`` to ``max_size``
    lock.mdb   LMDB's reader table

What the disk tier (:mod:`kvstore.tiers.lmdb.tier`) needs from LMDB besides reads and puts:

- :meth:`LmdbEnv.open`: the files are checked against their meta pages first (:func:`check_environment`:
  a truncated map would ``SIGBUS``), opened owner-only, and LMDB's open errors become :class:`TierError`
  naming the file and what to do;
- :meth:`LmdbEnv.txn`: a write transaction that grows the map on ``MapFullError`` until ``max_size``
  (readers are held off by a :class:`ResizeGate` while the map moves); only at the cap does the error
  reach the caller, which evicts;
- :meth:`LmdbEnv.cost`: the bytes a value occupies, the unit of the tier's eviction budget.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Iterator

import lmdb

from kvstore.errors import TierError
from kvstore.tiers.datadir import FILE_MODE, narrow
from kvstore.tiers.lmdb.gate import ResizeGate
from kvstore.tiers.lmdb.value import (MapWindow, ValueOutOfBounds, checked_items, file_mappings, new_mapping,
                                      read_node)
from kvstore.tiers.lmdb.check import check_environment, damaged

log = logging.getLogger(__name__)
LRU_RECORD = struct.Struct("<QQ")
"""A block's record in the ``lru`` database: last-access counter, accounted bytes."""
_NODE = 8 + 32  # LMDB node header + key bytes


def block_budget(max_size: int, page_size: int | None = None) -> int:
    """Bytes an environment of ``max_size`` lets its blocks occupy: the map (whole pages) less a reserve for
    meta, branch and freelist pages (16 pages and a sixteenth)."""
    page = page_size or (os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096)
    rounded = max_size // page * page
    return rounded - (16 * page + rounded // 16)


class LmdbEnv:
    """One LMDB environment at ``path`` with a map of at most ``max_size`` bytes (rounded down to pages)."""

    def __init__(self, path: str, max_size: int, map_step: int, *, sync: bool, readahead: bool) -> None:
        """Open (creating if needed) the environment; ``sync``: LMDB fsyncs every commit (``disk.sync: always``)."""
        self.path = path
        self.page_size = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.max_size = max_size // self.page_size * self.page_size
        self.reserve = self.max_size - block_budget(max_size, self.page_size)
        """Bytes kept from the eviction budget for meta, branch and freelist pages."""
        self.step = max(self.page_size, map_step // self.page_size * self.page_size)
        self.gate = ResizeGate()
        """Read transactions enter it; a map resize waits for them to leave."""
        self.data_file = os.path.join(path, "data.mdb")
        before = file_mappings(self.data_file)
        self.env = self._open(sync, readahead)
        self._map_size = int(self.env.info()["map_size"])
        self.psize = int(self.env.stat()["psize"])
        """LMDB's page size for this environment (read once: ``Environment.stat`` takes ~1 ms)."""
        self.map_base = new_mapping(self.data_file, before)
        """Where the map starts in this process (values are checked against it before they are read)."""

    @property
    def budget(self) -> int:
        """Bytes the blocks may occupy (:meth:`cost` summed): ``max_size`` less :attr:`reserve`."""
        return self.max_size - self.reserve

    def cost(self, vlen: int) -> int:
        """Bytes a value of ``vlen`` occupies: its pages (or twice its leaf node) plus its ``lru`` record."""
        psize = self.page_size
        if _NODE + vlen > psize // 2 - 16:  # LMDB moves nodes above ~half a page to overflow pages
            data = -(-(vlen + 16) // psize) * psize + 2 * (_NODE + 8)
        else:
            data = 3 * (_NODE + vlen + 2)
        return data + 3 * (_NODE + LRU_RECORD.size + 2)

    def map_size(self) -> int:
        """Current map size in bytes (never above ``max_size``)."""
        return self._map_size

    def window(self, max_value: int) -> MapWindow:
        """Where the values of a transaction begun now may lie (:mod:`kvstore.tiers.lmdb.value`)."""
        return MapWindow.of(self.map_base, self._map_size, self.psize, max_value)

    def txn(self, body: Callable[[lmdb.Transaction], object]) -> None:
        """Run ``body`` in a write transaction, growing the map on ``MapFullError`` until it reaches
        ``max_size``; only then does the error propagate (to the tier, never further). Any other LMDB
        error (a damaged page, an I/O error) becomes :class:`TierError` naming the file."""
        while True:
            try:
                with self.env.begin(write=True, buffers=True) as txn:  # buffers: values are checked before read
                    body(txn)
                return
            except lmdb.MapFullError:
                if self.map_size() >= self.max_size:
                    raise
                try:
                    with self.gate.exclusive():
                        before = file_mappings(self.data_file)
                        self.env.set_mapsize(min(self.max_size, self.map_size() + self.step))
                        self._map_size = int(self.env.info()["map_size"])
                        self.map_base = new_mapping(self.data_file, before)  # LMDB mapped it anew
                except lmdb.Error as exc:
                    raise self.write_error(exc) from None
            except lmdb.Error as exc:
                raise self.write_error(exc) from None

    def txn_or_fail(self, body: Callable[[lmdb.Transaction], object]) -> None:
        """:meth:`txn` for deletes and bookkeeping: a full map at the cap becomes :class:`TierError`.

        The eviction reserve exists so this cannot happen; if it does, the message says what to change.
        """
        try:
            self.txn(body)
        except lmdb.MapFullError:
            raise TierError(f"LMDB map at {self.path} is full at disk.max_size={self.max_size}; raise it") from None

    def sync(self) -> None:
        """fsync the environment; :class:`TierError` if it fails."""
        try:
            self.env.sync(True)
        except lmdb.Error as exc:
            raise self.write_error(exc) from None

    def write_error(self, exc: lmdb.Error) -> TierError:
        """A failed write or sync as :class:`TierError`; the damage hint only when LMDB reports damage."""
        if isinstance(exc, (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError)):
            return damaged(self.path, f"is damaged ({exc})")
        return TierError(f"LMDB write to {self.path}/data.mdb failed: {exc}")

    def access_records(self, blocks: lmdb._Database, lru: lmdb._Database,
                       max_value: int) -> tuple[list[tuple[int, bytes, int]], list[tuple[bytes, int]]]:
        """``(clock, key, cost)`` of every block in ``blocks`` as recorded in ``lru``, oldest access first, and
        ``(key, cost)`` of blocks with no record (after a foreign writer or a damaged ``lru`` database:
        found by a scan of the keys and their leaf nodes; the overflow pages holding the values are never
        touched, and a node whose size is out of bounds (:mod:`kvstore.tiers.lmdb.value`) is costed as
        ``max_value``, the longest value a block encodes to: the first get of it drops it). Records of
        blocks that are gone are left out. Changes nothing."""
        records: list[tuple[int, bytes, int]] = []
        orphans: list[tuple[bytes, int]] = []
        with self.env.begin(buffers=True) as txn:
            window = self.window(LRU_RECORD.size)
            for key, raw in checked_items(txn.cursor(db=lru), window):
                if len(key) == 32 and raw is not None and len(raw) == LRU_RECORD.size:
                    clock, cost = LRU_RECORD.unpack(raw)
                    records.append((clock, key, cost))
            if txn.stat(blocks)["entries"] != len(records):
                known = {key for _, key, _ in records}
                present = dict(self.node_sizes(txn.cursor(db=blocks), max_value))
                records = [r for r in records if r[1] in present]
                orphans = [(k, self.cost(n)) for k, n in present.items() if k not in known]
        records.sort()
        return records, orphans

    def node_sizes(self, cursor: lmdb.Cursor, max_value: int) -> Iterator[tuple[bytes, int]]:
        """``(key, value size)`` of every node of ``cursor``'s database, read from the nodes alone (no value
        is touched); a size out of bounds reads as ``max_value``."""
        window = self.window(max_value)
        for key_buf in cursor.iternext(values=False):
            key = bytes(key_buf)
            try:
                size = read_node(key, key_buf, window).size if window.known else max_value
            except ValueOutOfBounds:
                size = max_value
            yield key, min(size, max_value)

    def close(self) -> None:
        """Close the environment."""
        self.env.close()

    def _open(self, sync: bool, readahead: bool) -> lmdb.Environment:
        check_environment(self.path)
        data_file = os.path.join(self.path, "data.mdb")
        existing = os.path.getsize(data_file) if os.path.exists(data_file) else 0
        if existing == 0 and os.path.exists(data_file):  # a crash while LMDB created it, or a file cut to nothing
            log.warning("LMDB data file %s is empty (0 bytes): starting a new, empty environment there; any blocks "
                        "it held are gone", data_file)
        map_size = min(self.max_size, max(self.step, -(-existing // self.step) * self.step))
        try:
            env = lmdb.open(
                self.path, map_size=map_size, max_dbs=2, sync=sync, metasync=sync,
                readahead=readahead, meminit=False, max_readers=256, mode=FILE_MODE,
            )
        except lmdb.Error as exc:
            if isinstance(exc, lmdb.ReadonlyError) or any(s in str(exc) for s in ("Permission denied", "Read-only")):
                raise TierError(f"LMDB environment {data_file} cannot be opened for writing ({exc}); "
                                f"make disk.path {self.path} and its files writable by this user") from None
            raise damaged(self.path, f"cannot be opened ({exc})") from None
        for name in ("data.mdb", "lock.mdb"):  # created 0600 now; narrow files an older build left 0644
            narrow(os.path.join(self.path, name), FILE_MODE)
        return env
