"""Making every committed block durable: what :meth:`TieredStore.flush <kvstore.store.tiered.TieredStore.flush>` writes.

Under ``write_through`` a committed block is copied down at commit, so a flush only waits for those copies.
Under ``write_back`` (the default: host and disk then hold distinct blocks) and ``write_through_selective``
a block reaches the disk only when it leaves the tier above, so at a flush blocks held only by the GPU or
only by the host tier are written straight to the disk tier here, never through host (a flush does not
fill host with copies of the GPU's blocks). A block the disk acknowledged stays there: the exclusive tiers'
loads leave its disk copy in place (:meth:`Placement.leave_host <kvstore.store.placement.Placement.leave_host>`),
and only the disk's own capacity evicts it.

Sources are held while they are copied (a GPU reference, a host pin that is not a use), chosen and released
under the hierarchy lock; the copies and the disk writes run outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.store.hierarchy import Hierarchy
from kvstore.store.host_slot import HostSlot
from kvstore.store.transfer import copy_bytes, staging_buffer

BATCH = 64
"""Blocks per disk put (one LMDB transaction)."""


@dataclass
class _Source:
    """One block to write down and the copy it is read from (a pinned host slot, else a referenced GPU block)."""

    key: bytes
    host: HostSlot | None = None
    gpu_block: int | None = None


def write_all_down(h: Hierarchy) -> int:
    """Copy every indexed block the disk tier has no record of to it, from host if host holds it, else from the
    GPU; returns how many the disk stored. Call without the lock; the disk's own flush makes them durable.
    Blocks committed while it runs may be missed (a flush covers what was committed before it began)."""
    if h.disk is None:
        return 0
    pl = h.placement
    todo: list[_Source] = []
    with h.lock:
        for node in h.index.nodes():
            for e in node.entries:
                if e.on_disk:
                    continue
                if e.host_slot is not None:
                    slot = pl.pin_host(e.key, use=False)  # the store's own read: not a use
                    if slot is not None:
                        todo.append(_Source(e.key, host=slot))
                        continue
                if e.gpu_block is not None:
                    pl.ref([e.gpu_block])  # held until the copy is written
                    todo.append(_Source(e.key, gpu_block=e.gpu_block))
    stored = 0
    try:
        for at in range(0, len(todo), BATCH):
            stored += _put(h, todo[at : at + BATCH])
    finally:
        with h.lock:
            for s in todo:
                if s.host is not None:
                    pl.release(s.host)
                elif s.gpu_block is not None:
                    pl.unref([s.gpu_block])
    return stored


def _put(h: Hierarchy, batch: list[_Source]) -> int:
    """Write one batch to the disk tier and record the copies it stored."""
    assert h.disk is not None
    pl = h.placement
    data: list[torch.Tensor] = []
    for s in batch:
        if s.host is not None:
            data.append(pl.view(s.host))
        else:
            assert s.gpu_block is not None
            src = h.pool.block_bytes(s.gpu_block)
            data.append(src if src.device.type == "cpu" else copy_bytes(staging_buffer(h.layout, pin=True), src))
    ok = h.disk.put([s.key for s in batch], data)
    keys = [s.key for s, stored in zip(batch, ok) if stored]
    uses: list[int] = []
    with h.lock:
        for key in keys:
            pl.mark_on_disk(key)
            h.counters.spilled_blocks["disk"] += 1
            h.events.put("stored", key, "disk")
            n = pl.uses_of(key)
            if n is not None:
                uses.append(n)
    if uses and len(uses) == len(keys):
        h.disk.seed_uses(keys, uses)
    return len(keys)
