"""Start the disk tier afresh while keeping a damaged LMDB environment for inspection.

::

    <path>                      ─rename─►  <path>.damaged-<UTC time>     (kept, never modified)
    (fresh, empty) <path>       ◄─salvage─ every block that still verifies (optional)

The move happens under the data directory's lock (:class:`DirLock`), so a
running daemon or embedded store is never pulled from under its feet: repair
is refused, naming it. Salvage reads the moved environment read-only; a
truncated ``data.mdb`` is first copied and padded with zeros to the size its
meta page promises (a sparse copy), so pages past the old end read as damaged
pages, never as ``SIGBUS``. Every value goes through :func:`decode_into` with
its key and the configured layout's fingerprint; what fails is left behind
and counted. Salvaged blocks are written through :class:`DiskTier`, so they
are re-encoded in the current format under the configured cap.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

import lmdb
import numpy as np

from kvstore.codec import decode_into
from kvstore.config.schema import DiskConfig
from kvstore.errors import CorruptBlock, TierError
from kvstore.layout import KVLayout
from kvstore.tiers.datadir import DirLock
from kvstore.tiers.lmdbcheck import DATA_FILE, expected_size

SALVAGE_BATCH = 64


@dataclass
class RepairReport:
    """What :func:`repair_disk` did."""

    moved_to: str | None
    """Where the damaged environment now is (``None``: there was nothing at ``disk.path``)."""
    salvaged: int = 0
    """Blocks copied into the fresh environment (each verified with its key)."""
    failed: int = 0
    """Stored values that could not be read (damaged page) or failed verification (damaged, other layout,
    old format), left behind."""
    walk_error: str | None = None
    """Why listing the damaged environment's keys was incomplete (a damaged page, not an LMDB file), if it was."""


def damaged_name(path: str, now: float | None = None) -> str:
    """``<path>.damaged-<UTC time>``, with ``-2``, ``-3``... if that exists already."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    base = f"{os.path.abspath(path)}.damaged-{stamp}"
    name, n = base, 1
    while os.path.lexists(name):
        n += 1
        name = f"{base}-{n}"
    return name


def repair_disk(section: DiskConfig, layout: KVLayout, *, salvage: bool) -> RepairReport:
    """Move the environment at ``section.path`` aside and (``salvage``) copy its verifiable blocks into a fresh one.

    Raises :class:`TierError` if a process holds the directory, or the move fails.
    """
    path = os.path.abspath(section.directory())
    if not os.path.lexists(path):
        return RepairReport(moved_to=None)
    if not os.path.isdir(path):
        raise TierError(f"disk.path {path} is not a directory; move it away by hand")
    lock = DirLock(path, "disk.path")
    try:
        moved = damaged_name(path)
        os.rename(path, moved)
    except OSError as exc:
        raise TierError(f"cannot move {path} aside: {exc.strerror or exc}") from None
    finally:
        lock.release()
    report = RepairReport(moved_to=moved)
    if salvage:
        _salvage(moved, section, layout, report)
    return report


def _salvage(source: str, section: DiskConfig, layout: KVLayout, report: RepairReport) -> None:
    from kvstore.tiers.disk import DiskTier

    try:
        need = expected_size(os.path.join(source, DATA_FILE))
    except TierError as exc:
        report.walk_error = str(exc)
        return
    if need is None:
        return
    scratch = os.path.join(source, "salvage-scratch")
    readable = source
    if os.path.getsize(os.path.join(source, DATA_FILE)) < need:
        os.mkdir(scratch, 0o700)
        shutil.copyfile(os.path.join(source, DATA_FILE), os.path.join(scratch, DATA_FILE))
        os.truncate(os.path.join(scratch, DATA_FILE), need)  # zeros past the cut: damaged pages, not SIGBUS
        readable = scratch
    tier = DiskTier.from_config(section, layout)
    try:
        _copy_verified(readable, need, tier, layout, report)
        tier.flush()
    finally:
        tier.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _known_keys(env: lmdb.Environment, report: RepairReport) -> list[bytes]:
    """Every block key either database still leads to: ``lru`` holds one record per block, so a damaged
    ``blocks`` page that cuts a cursor walk short does not hide the keys behind it (and vice versa)."""
    keys: dict[bytes, None] = {}
    for name in (b"lru", b"blocks"):
        try:
            with env.begin(buffers=True) as txn:
                db = env.open_db(name, txn=txn, create=False)
                for key in txn.cursor(db=db).iternext(keys=True, values=False):
                    if len(key) == 32:
                        keys[bytes(key)] = None
        except lmdb.Error as exc:
            report.walk_error = f"the {name.decode()} database has a damaged page ({exc})"
    return list(keys)


def _copy_verified(source: str, map_size: int, tier: object, layout: KVLayout, report: RepairReport) -> None:
    """Read each known key on its own (a damaged page fails that key's read only) and put what verifies."""
    import torch

    dest = np.empty(layout.bytes_per_block, dtype=np.uint8)
    batch: dict[bytes, torch.Tensor] = {}

    def put_batch() -> None:
        report.salvaged += sum(tier.put(list(batch), list(batch.values())))  # type: ignore[attr-defined]
        batch.clear()

    try:
        env = lmdb.open(source, readonly=True, lock=False, max_dbs=2, map_size=max(map_size, 1 << 20))
    except lmdb.Error as exc:
        report.walk_error = f"cannot open {source}: {exc}"
        return
    try:
        keys = _known_keys(env, report)
        pos = 0
        while pos < len(keys):
            with env.begin(buffers=True) as txn:
                db = env.open_db(b"blocks", txn=txn, create=False)
                for key in keys[pos:]:
                    pos += 1
                    try:
                        value = txn.get(key, db=db)
                    except lmdb.Error:
                        report.failed += 1
                        break  # the transaction may be failed now: continue in a fresh one
                    if value is None:
                        continue
                    try:
                        decode_into(value, dest, layout.fingerprint, key)
                    except CorruptBlock:
                        report.failed += 1
                        continue
                    batch[key] = torch.from_numpy(dest.copy())
                    if len(batch) >= SALVAGE_BATCH:
                        put_batch()
    except lmdb.Error as exc:
        report.walk_error = f"reading {source} failed: {exc}"
    finally:
        env.close()
    if batch:
        put_batch()
