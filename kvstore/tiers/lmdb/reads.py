"""How the disk tier reads a get batch: contiguous runs, each on its own thread in its own read transactions.

A batch of at least ``2 * READ_SPLIT_BYTES`` is split into up to ``disk.read_threads`` runs
(:func:`split_runs`), read at once: every run's page faults are a separate stream of disk reads, so
several are in flight, as in the disk's parallel read limit that ``kvstore bench tiers`` measures (one
thread faults one region at a time). Each value is decoded straight from the map into its destination
(:func:`decode_into`: header and CRC-32 of the decoded bytes, bound to the key). A run changes no state
shared with other runs; the tier merges what they found (:class:`RunRead`).

Values are found with ``Cursor.set_key`` and checked against the pages LMDB wrote before a byte of
them is touched (:mod:`kvstore.tiers.lmdb.value`: a damaged node size would otherwise fault past the
file or the map); py-lmdb's ``Transaction.get`` touches every page of a value before it returns, so it
is never used on ``blocks``. A value out of bounds is a corrupt block (counted, deleted when that is
safe) or, inside its leaf page, an unreadable one.

Cold reads need kernel readahead (``readahead=True``): the first touch of a value is its decode, and
under LMDB's ``MADV_RANDOM`` map (``readahead=False``) each touch is a synchronous 4 KiB read
(50-70 MB/s on the dev VM); with readahead a batch (mostly in put order in ``data.mdb``) streams at
disk rate. The price is read-around on cold leaf pages.

The victim hook reads through the write transaction that evicts (:func:`txn_reader`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import lmdb

from kvstore.tiers.codec import decode_into
from kvstore.errors import CorruptBlock
from kvstore.tiers.base import BlockReader, Buffer, check_buffers
from kvstore.tiers.lmdb.env import LmdbEnv
from kvstore.tiers.lmdb.value import MapWindow, ValueOutOfBounds, bounded_value

READ_SPLIT_BYTES = 1 << 20
"""Least bytes of a get batch worth handing to another reading thread (smaller runs cost more to hand over
than the overlap of their reads saves)."""


@dataclass
class RunRead:
    """What one reading thread found in its run of a get batch."""

    found: list[bool]
    corrupt: list[bytes]
    unreadable: int


def split_runs(n: int, bytes_per_block: int, threads: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of a batch of ``n`` blocks, one per reading thread: as many as ``threads`` allows
    with at least :data:`READ_SPLIT_BYTES` each (one run for a small batch)."""
    if n == 0:
        return []
    parts = max(1, min(threads, n * bytes_per_block // READ_SPLIT_BYTES, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return list(zip(bounds, bounds[1:]))


class RunReader:
    """Reads runs of a batch from the ``blocks`` database ``db`` of ``env``.

    ``unreadable(key, exc)`` is told of a damaged page on a key's path (or a value out of bounds inside
    its leaf), ``corrupt(exc)`` of a value that failed verification (both log; the tier counts and drops).
    ``max_value``: the longest value one block encodes to."""

    def __init__(self, env: LmdbEnv, db: lmdb._Database, fingerprint: bytes, max_value: int,
                 unreadable: Callable[[bytes, Exception], object], corrupt: Callable[[CorruptBlock], object]) -> None:
        self._env, self._db, self._fp, self._max_value = env, db, fingerprint, max_value
        self._unreadable, self._corrupt = unreadable, corrupt

    def read(self, keys: Sequence[bytes], dests: Sequence[Buffer], lo: int, hi: int) -> RunRead:
        """Read ``keys[lo:hi]`` into ``dests[lo:hi]`` in read transactions of this thread."""
        run = RunRead([False] * (hi - lo), [], 0)
        pos = lo
        while pos < hi:
            with self._env.gate.reading():
                txn = self._env.env.begin(db=self._db, buffers=True)
                try:
                    window = self._env.window(self._max_value)
                    cursor = txn.cursor()
                    for i in range(pos, hi):
                        pos = i + 1
                        key = keys[i]
                        try:
                            value = bounded_value(cursor, key, window)
                        except ValueOutOfBounds as exc:
                            if exc.deletable:
                                run.corrupt.append(key)
                                self._corrupt(exc)
                            else:  # deleting its node would move that many bytes in the page: left for repair
                                run.unreadable += 1
                                self._unreadable(key, exc)
                            continue
                        except lmdb.Error as exc:
                            # A damaged page on this key's path: a miss, never an exception for the caller.
                            # Not deleted (the delete would walk the same page); LMDB may have failed the
                            # transaction, so the rest of the run continues in a fresh one.
                            run.unreadable += 1
                            self._unreadable(key, exc)
                            break
                        if value is None:
                            continue
                        try:
                            decode_into(value, dests[i], self._fp, key)
                            run.found[i - lo] = True
                        except CorruptBlock as exc:
                            run.corrupt.append(key)
                            self._corrupt(exc)
                finally:
                    txn.abort()
        return run


def txn_reader(txn: lmdb.Transaction, db: lmdb._Database, fingerprint: bytes, bytes_per_block: int,
               window: MapWindow) -> BlockReader:
    """A :data:`BlockReader` on the open transaction ``txn`` (``buffers=True``; a corrupt, unreadable or
    out-of-bounds value reads ``False``)."""

    def read(keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        check_buffers(keys, dests, bytes_per_block, "disk")
        cursor = txn.cursor(db=db)
        out: list[bool] = []
        for key, dest in zip(keys, dests):
            try:
                value = bounded_value(cursor, key, window)
                ok = value is not None
                if ok:
                    decode_into(value, dest, fingerprint, key)
            except (lmdb.Error, CorruptBlock):
                ok = False
            out.append(ok)
        return out

    return read
