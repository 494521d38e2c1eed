"""LMDB's own put bandwidth by transaction size: why :data:`kvstore.tiers.lmdb.tier.TXN_BYTES` is what it is.

The same values (no codec, no checksum, no eviction: plain ``txn.put`` of
``bytes``) go into a fresh environment opened as the disk tier opens it
(``sync=False``, growing map), committed in transactions of a given size, then
one ``env.sync``. On this 2-core VM (2026-12-02), transactions of 1-2 MiB
committed at 1.0-1.4 GB/s and transactions of 4-16 MiB at 0.25-0.6 GB/s with
most of the time spent in the kernel, at 64 KiB to 1 MiB values; the ``tiers``
suite measures it again in each run (``lmdb_raw.put`` by ``txn_bytes``).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import lmdb

TXN_SIZES = (1 << 20, 2 << 20, 4 << 20, 16 << 20)
"""Transaction sizes swept, in value bytes."""


def lmdb_put_gbps(root: Path, value_bytes: int, total_bytes: int, txn_bytes: int) -> float:
    """GB/s of putting ``total_bytes`` of ``value_bytes`` values into a fresh environment under ``root``
    in transactions of about ``txn_bytes`` (at least one value), sync included; the environment is removed."""
    n = max(1, total_bytes // value_bytes)
    per_txn = max(1, txn_bytes // value_bytes)
    value = os.urandom(value_bytes)
    path = root / f"lmdb-txn-{value_bytes}-{txn_bytes}"
    path.mkdir()
    env = lmdb.open(str(path), map_size=max(64 << 20, 2 * n * value_bytes), sync=False, metasync=False,
                    meminit=False)
    try:
        t0 = time.perf_counter()
        for start in range(0, n, per_txn):
            with env.begin(write=True) as txn:
                for i in range(start, min(n, start + per_txn)):
                    txn.put(i.to_bytes(32, "big"), value)
        env.sync(True)
        return n * value_bytes / (time.perf_counter() - t0) / 1e9
    finally:
        env.close()
        shutil.rmtree(path)
