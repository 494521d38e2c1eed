"""The damaged-environment walk of ``kvstore repair``: a page that makes LMDB abort (an ``assert`` in
``mdb_cursor_next``) ends the walk in the child, keeps every entry read before it and names the abort;
an intact database is walked whole, keys only or with values."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import lmdb

from kvstore.tiers.lmdb.walk import walk


def _env(path: Path, n: int) -> dict[bytes, bytes]:
    env = lmdb.open(str(path), map_size=64 << 20, max_dbs=2)
    db = env.open_db(b"things")
    items = {struct.pack(">Q", i) + bytes(24): struct.pack("<QQ", i, 2 * i) for i in range(n)}
    with env.begin(write=True) as txn:
        for k, v in items.items():
            txn.put(k, v, db=db)
    env.close()
    return items


def test_an_intact_database_is_walked_whole(tmp_path: Path) -> None:
    items = _env(tmp_path, 500)
    size = os.path.getsize(tmp_path / "data.mdb")
    assert walk(str(tmp_path), size, "things").entries == sorted(items.items())
    keys_only = walk(str(tmp_path), size, "things", values=False)
    assert keys_only.error is None and keys_only.entries == [(k, b"") for k in sorted(items)]


def test_a_page_that_aborts_lmdb_ends_the_walk_not_the_caller(tmp_path: Path) -> None:
    items = _env(tmp_path, 500)
    data = tmp_path / "data.mdb"
    size = os.path.getsize(data)
    with open(data, "r+b") as f:  # zero a leaf in the middle (page flags 0: neither leaf nor branch)
        f.seek((size // 4096 // 2) * 4096)
        f.write(bytes(4096))
    cut = walk(str(tmp_path), size, "things")
    assert cut.error is not None and "SIGABRT" in cut.error and "IS_LEAF" in cut.error
    assert 0 < len(cut.entries) < len(items)
    assert cut.entries == sorted(items.items())[: len(cut.entries)]  # what came before the page, exactly


def test_a_missing_database_is_an_error_not_a_crash(tmp_path: Path) -> None:
    _env(tmp_path, 3)
    missing = walk(str(tmp_path), 64 << 20, "nothing")
    assert missing.entries == [] and missing.error is not None and "NotFoundError" in missing.error
