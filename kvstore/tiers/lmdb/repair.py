"""Start the disk tier afresh while keeping a damaged LMDB environment for inspection (the slab tier's
repair, :mod:`kvstore.tiers.slab.repair`, reuses the move and the safe mapping).

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import lmdb
import numpy as np
import torch

from kvstore.tiers.codec import decode_into, encoded_size_bound
from kvstore.config.schema import DiskConfig
from kvstore.errors import CorruptBlock, TierError
from kvstore.layout import KVLayout
from kvstore.tiers.base import Tier
from kvstore.tiers.datadir import DirLock
from kvstore.tiers.lmdb.value import MapWindow, ValueOutOfBounds, bounded_value, file_mappings, new_mapping
from kvstore.tiers.lmdb.walk import walk
from kvstore.tiers.lmdb.check import DATA_FILE, expected_size

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
    moved = move_aside(section.directory(), "disk.path")
    if moved is None:
        return RepairReport(moved_to=None)
    report = RepairReport(moved_to=moved)
    if salvage:
        with salvage_failure(report, "disk.path", section.directory()):
            _salvage(moved, section, layout, report)
    return report


@contextmanager
def salvage_failure(report: RepairReport, field: str, path: str) -> Iterator[None]:
    """Turn a :class:`TierError` of a salvage (a full disk, an I/O error on the fresh tier) into one that also
    says where the untouched damaged tier is and what the fresh one at ``path`` holds by then."""
    try:
        yield
    except TierError as exc:
        raise TierError(f"salvage stopped: {exc}. The damaged tier is kept untouched at {report.moved_to}; {field} "
                        f"{os.path.abspath(path)} holds the {report.salvaged} blocks salvaged before that") from None


def move_aside(directory: str, field: str) -> str | None:
    """Rename the data directory ``directory`` (config field ``field``) to :func:`damaged_name`, under its lock;
    where it went, or ``None`` if nothing is there. :class:`TierError` if a process holds it or the move fails."""
    path = os.path.abspath(directory)
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        raise TierError(f"{field} {path} is not a directory; move it away by hand")
    lock = DirLock(path, field)
    try:
        moved = damaged_name(path)
        os.rename(path, moved)
    except OSError as exc:
        raise TierError(f"cannot move {path} aside: {exc.strerror or exc}") from None
    finally:
        lock.release()
    return moved


def readable_environment(source: str, scratch: str, report: RepairReport) -> tuple[str, int] | None:
    """The LMDB environment ``source`` as a directory safe to map read-only, and its map size: ``source`` itself,
    or for a truncated ``data.mdb`` a sparse copy in ``scratch`` padded with zeros to the size its meta page
    promises (pages past the cut read as damaged pages, never ``SIGBUS``). ``None`` (why in ``report``): unusable."""
    try:
        need = expected_size(os.path.join(source, DATA_FILE))
    except TierError as exc:
        report.walk_error = str(exc)
        return None
    if need is None:
        return None
    if os.path.getsize(os.path.join(source, DATA_FILE)) >= need:
        return source, need
    os.mkdir(scratch, 0o700)
    shutil.copyfile(os.path.join(source, DATA_FILE), os.path.join(scratch, DATA_FILE))
    os.truncate(os.path.join(scratch, DATA_FILE), need)
    return scratch, need


def _salvage(source: str, section: DiskConfig, layout: KVLayout, report: RepairReport) -> None:
    from kvstore.tiers.lmdb.tier import DiskTier

    scratch = os.path.join(source, "salvage-scratch")
    env = readable_environment(source, scratch, report)
    if env is None:
        return
    tier = DiskTier.from_config(section, layout)
    try:
        _copy_verified(env[0], env[1], tier, layout, report)
        tier.flush()
    finally:
        tier.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _known_keys(source: str, map_size: int, report: RepairReport) -> list[bytes]:
    """Every block key either database still leads to: ``lru`` holds one record per block, so a damaged
    ``blocks`` page that cuts a cursor walk short does not hide the keys behind it (and vice versa). The walks
    run in a child process (:mod:`kvstore.tiers.lmdb.walk`: LMDB aborts on some damaged pages)."""
    keys: dict[bytes, None] = {}
    for name in ("lru", "blocks"):
        found = walk(source, max(map_size, 1 << 20), name, values=False)
        if found.error:
            report.walk_error = found.error
        keys.update((key, None) for key, _ in found.entries if len(key) == 32)
    return list(keys)


class SalvageBatch:
    """Verified blocks on their way into the fresh tier, put :data:`SALVAGE_BATCH` at a time and counted."""

    def __init__(self, tier: Tier, report: RepairReport) -> None:
        self.tier, self.report = tier, report
        self._batch: dict[bytes, torch.Tensor] = {}

    def add(self, key: bytes, block: np.ndarray) -> None:
        """Queue a copy of ``block`` under ``key``; puts the batch once it is full."""
        self._batch[key] = torch.from_numpy(block.copy())
        if len(self._batch) >= SALVAGE_BATCH:
            self.finish()

    def finish(self) -> None:
        """Put what is queued; :attr:`RepairReport.salvaged` counts what the tier stored."""
        if self._batch:
            self.report.salvaged += sum(self.tier.put(list(self._batch), list(self._batch.values())))
            self._batch.clear()


def _copy_verified(source: str, map_size: int, tier: Tier, layout: KVLayout, report: RepairReport) -> None:
    """Read each known key on its own (a damaged page fails that key's read only) and put what verifies."""
    dest = np.empty(layout.bytes_per_block, dtype=np.uint8)
    batch = SalvageBatch(tier, report)

    data_file = os.path.join(source, DATA_FILE)
    before = file_mappings(data_file)
    try:
        env = lmdb.open(source, readonly=True, lock=False, max_dbs=2, map_size=max(map_size, 1 << 20))
    except lmdb.Error as exc:
        report.walk_error = f"cannot open {source}: {exc}"
        return
    base = new_mapping(data_file, before)
    try:
        keys = _known_keys(source, map_size, report)
        pos = 0
        while pos < len(keys):
            with env.begin(buffers=True) as txn:
                db = env.open_db(b"blocks", txn=txn, create=False)
                window = MapWindow.of(base, int(env.info()["map_size"]), int(env.stat()["psize"]),
                                      encoded_size_bound(layout.bytes_per_block))
                cursor = txn.cursor(db=db)
                for key in keys[pos:]:
                    pos += 1
                    try:
                        value = bounded_value(cursor, key, window)  # a damaged node size never faults
                    except ValueOutOfBounds:
                        report.failed += 1
                        continue
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
                    batch.add(key, dest)
    except lmdb.Error as exc:
        report.walk_error = f"reading {source} failed: {exc}"
    finally:
        env.close()
    batch.finish()
