"""Moving blocks down the hierarchy: GPU eviction, host eviction, and the write policies.

Eviction cascade (every step under the hierarchy lock)::

    GPU full  -> least recently used unlocked blocks the index alone holds:
                 copy to host if no lower tier has them yet, then free the GPU block
    host full -> least recently used unlocked host slots:
                 copy to disk if not there yet, then free the slot
    disk full -> the disk tier deletes its least recently used entries itself

Write policies decide when committed blocks are copied down before any
eviction: ``write_through`` at commit, ``write_through_selective`` once a
block was hit ``selective_hits`` times, ``write_back`` only on eviction.
Write-downs run on a worker thread; the GPU block holds an extra reference
while it is being read so that nobody reuses it mid-copy.
"""

from __future__ import annotations

import logging
from contextlib import closing
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvstore.config.schema import PolicyConfig
from kvstore.errors import BlockStateError
from kvstore.hierarchy import Hierarchy
from kvstore.radix import BlockEntry
from kvstore.transfer import copy_bytes, staging_buffer

log = logging.getLogger("kvstore.spill")


class Spiller:
    """Evicts and writes blocks down the hierarchy for one :class:`Hierarchy`."""

    def __init__(self, h: Hierarchy, policy: PolicyConfig) -> None:
        self.h = h
        self.policy = policy
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-writedown")
        self._pending: set[Future[None]] = set()

    # ------------------------------------------------------------ GPU side
    def ensure_gpu_free(self, n: int) -> int:
        """Evict cached-but-unused GPU blocks until ``n`` are free (or nothing more can go); returns free count."""
        h = self.h
        with h.lock:
            if h.pool.num_free >= n:
                return h.pool.num_free

            def evictable(node) -> bool:  # noqa: ANN001
                return any(e.gpu_block is not None and h.pool.ref_count(e.gpu_block) == 1 for e in node.entries)

            with closing(h.index.iter_lru(evictable)) as candidates:  # lazy: stops as soon as enough is free
                for node in candidates:
                    for entry in reversed(list(node.entries)):
                        if h.pool.num_free >= n:
                            return h.pool.num_free
                        b = entry.gpu_block
                        if b is not None and h.pool.ref_count(b) == 1 and entry.node is node:
                            self._demote_gpu(entry)
                    if h.pool.num_free >= n:
                        break
            h.reap()
            return h.pool.num_free

    def _demote_gpu(self, entry: BlockEntry) -> None:
        h = self.h
        if entry.host_slot is None and not entry.on_disk and not self._copy_down(entry):
            h.drop_from(entry)  # nowhere to keep it: the block and its extensions leave the index
            h.counters.gpu_evictions += 1
            return
        b = entry.gpu_block
        assert b is not None
        h.index.set_gpu(entry, None)
        h.pool.free([b])
        h.counters.gpu_evictions += 1
        h.events.put("evicted", entry.key, "gpu")

    def _copy_down(self, entry: BlockEntry) -> bool:
        """Synchronously copy a GPU block to the host tier, else the disk tier. Returns success."""
        h = self.h
        assert entry.gpu_block is not None
        src = h.pool.block_bytes(entry.gpu_block)
        if h.host is not None:
            slot = self.host_slot_for(entry.key)
            if slot is not None:
                copy_bytes(h.host.slot_view(slot), src)
                h.host.publish([entry.key])
                h.index.set_host(entry, slot)
                h.counters.spilled_blocks["host"] += 1
                h.events.put("spilled", entry.key, "host")
                return True
        if h.disk is not None:
            data = src if src.device.type == "cpu" else copy_bytes(staging_buffer(h.layout, pin=False), src)
            if h.disk.put([entry.key], [data])[0]:
                h.index.set_disk(entry, True)
                h.counters.spilled_blocks["disk"] += 1
                h.events.put("spilled", entry.key, "disk")
                return True
        return False

    # ----------------------------------------------------------- host side
    def host_slot_for(self, key: bytes) -> int | None:
        """Reserve a host slot for ``key`` (locked, unpublished), spilling host victims to make room.

        ``None`` when every slot is locked. Raises :class:`BlockStateError` when
        the host tier already holds ``key`` or another load has reserved it.
        """
        host = self.h.host
        assert host is not None
        slot = host.reserve([key])[0]  # raises BlockStateError if present or being loaded
        if slot is None:
            self.make_host_room(1)
            slot = host.reserve([key])[0]
        return slot

    def _try_host_slot(self, key: bytes) -> int | None:
        """:meth:`host_slot_for`, or ``None`` when another load of the same block holds a reservation."""
        try:
            return self.host_slot_for(key)
        except BlockStateError:
            return None

    def make_host_room(self, n: int) -> int:
        """Free up to ``n`` host slots, least recently used first, copying each to disk first if needed."""
        h = self.h
        host = h.host
        assert host is not None
        freed = 0
        with h.lock:
            for key in host.lru_victims(n):
                entry = h.index.get(key)
                if h.disk is not None and not (entry is not None and entry.on_disk) and not h.disk.contains(key):
                    slot = host.slot_of(key)
                    if slot is not None and h.disk.put([key], [host.slot_view(slot)])[0]:
                        h.counters.spilled_blocks["disk"] += 1
                        h.events.put("spilled", key, "disk")
                        if entry is not None:
                            h.index.set_disk(entry, True)
                host.delete([key])
                freed += 1
                h.events.put("evicted", key, "host")
                if entry is not None:
                    h.index.set_host(entry, None)
                    if entry.tier is None:
                        h.drop_from(entry)
        return freed

    # -------------------------------------------------------- write policy
    def on_commit(self, entries: Sequence[BlockEntry]) -> None:
        """Apply the write policy to freshly committed blocks."""
        if self.policy.write == "write_through":
            self.write_down(entries)

    def on_hit(self, entries: Sequence[BlockEntry]) -> None:
        """Apply the write policy to blocks a lookup just matched."""
        if self.policy.write == "write_through_selective":
            due = [e for e in entries if e.hits >= self.policy.selective_hits]
            self.write_down(due)

    def write_down(self, entries: Sequence[BlockEntry]) -> None:
        """Schedule copies of GPU-resident blocks to every lower tier that lacks them."""
        h = self.h
        todo: list[tuple[BlockEntry, int]] = []
        with h.lock:
            for e in entries:
                needs = (h.host is not None and e.host_slot is None) or (h.disk is not None and not e.on_disk)
                if e.gpu_block is not None and needs:
                    h.pool.incref([e.gpu_block])  # held until the copy is done
                    todo.append((e, e.gpu_block))
        if todo:
            fut = self._writer.submit(self._write_down_job, todo)
            self._pending.add(fut)
            fut.add_done_callback(self._pending.discard)

    def _write_down_job(self, todo: list[tuple[BlockEntry, int]]) -> None:
        h = self.h
        for entry, block in todo:
            try:
                src = h.pool.block_bytes(block)
                disk_src: torch.Tensor | None = src if src.device.type == "cpu" else None
                with h.lock:
                    alive = entry.node is not None
                    if alive and h.host is not None and entry.host_slot is None and h.host.contains(entry.key):
                        h.index.set_host(entry, h.host.lock([entry.key])[0])  # another writer got there first
                        disk_src = h.host.slot_view(entry.host_slot)  # type: ignore[arg-type]
                    elif alive and h.host is not None and entry.host_slot is None:
                        slot = self._try_host_slot(entry.key)
                        if slot is not None:
                            view = h.host.slot_view(slot)
                            copy_bytes(view, src)
                            h.host.lock([entry.key])  # held until the disk copy below is done
                            h.host.publish([entry.key])
                            h.index.set_host(entry, slot)
                            h.counters.spilled_blocks["host"] += 1
                            h.events.put("stored", entry.key, "host")
                            disk_src = view
                        else:
                            log.debug("write-down of %s: no host slot free", entry.key.hex()[:16])
                            disk_src = src if src.device.type == "cpu" else copy_bytes(staging_buffer(h.layout, pin=True), src)
                    elif alive and h.host is not None and entry.host_slot is not None:
                        h.host.lock([entry.key])
                        disk_src = h.host.slot_view(entry.host_slot)
                    elif disk_src is None:
                        disk_src = copy_bytes(staging_buffer(h.layout, pin=True), src)
                    need_disk = alive and h.disk is not None and not entry.on_disk
                locked_host = h.host is not None and entry.host_slot is not None and alive
                if need_disk and disk_src is not None:
                    assert h.disk is not None
                    ok = h.disk.put([entry.key], [disk_src])[0]
                    with h.lock:
                        if ok and entry.node is not None:
                            h.index.set_disk(entry, True)
                            h.counters.spilled_blocks["disk"] += 1
                            h.events.put("stored", entry.key, "disk")
                if locked_host:
                    assert h.host is not None
                    h.host.unlock([entry.key])
            finally:
                with h.lock:
                    h.pool.free([block])

    def pending(self) -> bool:
        """Whether write-downs are scheduled or running."""
        return bool(self._pending)

    def wait(self) -> None:
        """Block until every scheduled write-down has finished."""
        for fut in list(self._pending):
            fut.result()

    def close(self) -> None:
        """Finish pending write-downs and stop the worker."""
        self.wait()
        self._writer.shutdown(wait=True)
