"""``kvstore repair`` for the slab tier: move a damaged ``slab.path`` aside (kept for inspection), start afresh,
and optionally salvage every block that still verifies.

::

    <slab.path>                 ─rename─►  <slab.path>.damaged-<UTC time>   (kept, never modified)
      index/ (LMDB key -> slot)              walked read-only (a truncated data.mdb: a padded sparse copy)
      slots.dat                              each indexed slot read with pread, verified with its key
    (fresh, empty) <slab.path>  ◄─salvage─ every block that verifies, written through :class:`SlabTier`

The index is the only record of which key owns which slot, so a block whose index entry is lost (a damaged
index page) cannot be salvaged; a slot past the end of a truncated ``slots.dat``, or one that fails the
key-bound CRC, is counted as failed. Salvaged blocks are written through :class:`SlabTier` under the
configured ``slab.max_size`` (the oldest recorded access is salvaged first, so the cap keeps the newest).
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from kvstore.tiers.codec import HEADER_SIZE, decode_into
from kvstore.config.schema import SlabConfig
from kvstore.errors import CorruptBlock
from kvstore.layout import KVLayout
from kvstore.tiers.lmdb.walk import walk
from kvstore.tiers.base import Tier
from kvstore.tiers.lmdb.repair import RepairReport, SalvageBatch, move_aside, readable_environment, salvage_failure
from kvstore.tiers.slab.data_file import slot_bytes
from kvstore.tiers.slab.index import RECORD

INDEX_DIR = "index"
DATA_FILE = "slots.dat"


def repair_slab(section: SlabConfig, layout: KVLayout, *, salvage: bool) -> RepairReport:
    """Move the slab tier at ``section.path`` aside and (``salvage``) copy its verifiable blocks into a fresh one.

    Raises :class:`~kvstore.errors.TierError` if a process holds the directory, or the move fails.
    """
    moved = move_aside(section.directory(), "slab.path")
    report = RepairReport(moved_to=moved)
    if moved is not None and salvage:
        with salvage_failure(report, "slab.path", section.directory()):
            _salvage(moved, section, layout, report)
    return report


def _salvage(source: str, section: SlabConfig, layout: KVLayout, report: RepairReport) -> None:
    from kvstore.tiers.slab.tier import SlabTier

    scratch = os.path.join(source, "salvage-scratch")
    env = readable_environment(os.path.join(source, INDEX_DIR), scratch, report)
    if env is None:
        return
    try:
        records = _records(env[0], env[1], os.path.join(source, INDEX_DIR), report)
        tier = SlabTier.from_config(section, layout)
        try:
            _copy_verified(os.path.join(source, DATA_FILE), records, tier, layout, report)
            tier.flush()
        finally:
            tier.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _records(readable: str, map_size: int, index: str, report: RepairReport) -> list[tuple[int, bytes, int]]:
    """``(last access, key, slot)`` of every entry the damaged index ``index`` (mapped from ``readable``) still
    leads to, oldest access first; a damaged page ends the walk (why in ``report``), keeping what came before."""
    found = walk(readable, max(map_size, 1 << 20), None)
    if found.error:
        report.walk_error = f"slab index {index}: {found.error}"
    out = [(clock, key, slot) for key, raw in found.entries if len(key) == 32 and len(raw) == RECORD.size
           for slot, clock in [RECORD.unpack(raw)]]
    out.sort()
    return out


def _copy_verified(data: str, records: list[tuple[int, bytes, int]], tier: Tier, layout: KVLayout,
                   report: RepairReport) -> None:
    """Read each record's slot from ``data`` on its own and put what verifies with its key into ``tier``."""
    value_len = HEADER_SIZE + layout.bytes_per_block
    size = slot_bytes(value_len)
    dest = np.empty(layout.bytes_per_block, dtype=np.uint8)
    batch = SalvageBatch(tier, report)

    try:
        fd = os.open(data, os.O_RDONLY)
    except OSError as exc:
        report.walk_error = f"cannot open {data}: {exc.strerror or exc}"
        report.failed += len(records)
        return
    try:
        for _, key, slot in records:
            try:
                value = os.pread(fd, value_len, slot * size)
                decode_into(memoryview(value), dest, layout.fingerprint, key)
            except (OSError, CorruptBlock):  # EIO, a slot past a truncated end (short read), damaged bytes
                report.failed += 1
                continue
            batch.add(key, dest)
    finally:
        os.close(fd)
    batch.finish()
