"""The slab tier's index: an LMDB environment of 32-byte key -> ``<QQ slot, last-access counter>``.

The only durable record of which key owns which slot of ``slots.dat`` (:mod:`kvstore.tiers.slab.data_file`);
the tier keeps an in-memory copy, rebuilt from :meth:`SlabIndex.records` at open. Every change is one
write transaction (:meth:`SlabIndex.write`), fsynced at commit under ``sync: always``, by
:meth:`SlabIndex.sync` otherwise. The environment is checked before it is mapped
(:mod:`kvstore.tiers.lmdb.check`): a truncated or foreign ``data.mdb`` is refused naming the file and what to do.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

import lmdb

from kvstore.errors import TierError
from kvstore.tiers.datadir import FILE_MODE, make_private_dir, narrow
from kvstore.tiers.lmdb.value import MapWindow, checked_items, file_mappings, new_mapping
from kvstore.tiers.lmdb.check import check_environment, damaged

RECORD = struct.Struct("<QQ")
"""An index value: slot, last-access counter."""


def hint(path: str) -> str:
    """What to do about a damaged index at ``path`` (:mod:`kvstore.tiers.slab.repair`)."""
    tier = os.path.dirname(path)
    return (f"to keep the damaged files for inspection and start with an empty tier, stop every kvstore process "
            f"using it and run `kvstore repair --config <your config>` (moves {tier} (slab.path) aside to "
            f"{tier}.damaged-<time>; add --salvage to copy the blocks that still verify into the new tier)")


class SlabIndex:
    """The LMDB environment at ``path`` (created 0700, files 0600)."""

    def __init__(self, path: str, *, durable_commits: bool, entries: int) -> None:
        """Open (creating) the environment; ``durable_commits``: fsync every commit; room for ``entries`` keys."""
        self.path = path
        make_private_dir(path)
        check_environment(path, hint(path))
        self._data_file = os.path.join(path, "data.mdb")
        before = file_mappings(self._data_file)
        try:
            self.env = lmdb.open(path, map_size=max(64 << 20, entries * 256), sync=durable_commits,
                                 metasync=durable_commits, readahead=False, max_readers=64, mode=FILE_MODE)
        except lmdb.Error as exc:
            raise damaged(path, f"cannot be opened ({exc})", hint(path)) from None
        self._map_base = new_mapping(self._data_file, before)
        for name in ("data.mdb", "lock.mdb"):  # narrow files a permissive umask left wider
            narrow(os.path.join(path, name), FILE_MODE)

    def records(self) -> list[tuple[int, bytes, int]]:
        """Every entry as ``(last access, key, slot)``, oldest access first; an entry whose node is damaged
        (its size out of bounds, :mod:`kvstore.tiers.lmdb.value`) is left out, never touched. Changes nothing."""
        out: list[tuple[int, bytes, int]] = []
        try:
            with self.env.begin(buffers=True) as txn:
                window = MapWindow.of(self._map_base, int(self.env.info()["map_size"]), int(self.env.stat()["psize"]),
                                      RECORD.size)
                for key, raw in checked_items(txn.cursor(), window):
                    if len(key) == 32 and raw is not None and len(raw) == RECORD.size:
                        slot, clock = RECORD.unpack(raw)
                        out.append((clock, bytes(key), slot))
        except lmdb.Error as exc:
            raise damaged(self.path, f"cannot be read ({exc})", hint(self.path)) from None
        out.sort()
        return out

    def write(self, deletes: Iterable[bytes] = (), puts: Iterable[tuple[bytes, int, int]] = ()) -> None:
        """One transaction: delete ``deletes``, then set each ``(key, slot, last access)`` of ``puts``."""
        try:
            with self.env.begin(write=True) as txn:
                for key in deletes:
                    txn.delete(key)
                for key, slot, clock in puts:
                    txn.put(key, RECORD.pack(slot, clock))
        except lmdb.Error as exc:
            raise TierError(f"slab index {self.path}/data.mdb write failed: {exc}") from None

    def sync(self) -> None:
        """fsync the environment: every commit so far is durable."""
        try:
            self.env.sync(True)
        except lmdb.Error as exc:
            raise TierError(f"sync of slab index {self.path}/data.mdb failed: {exc}") from None

    def close(self) -> None:
        """Close the environment."""
        self.env.close()
