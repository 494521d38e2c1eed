"""Moving blocks down the hierarchy: GPU eviction, host eviction, and the write policies.

Eviction cascade, in rounds; each round chooses under the hierarchy lock,
copies outside it and publishes under it again::

    GPU full  -> least recently used blocks only the cache holds (Placement.gpu_lru, O(1)):
                 free it if a lower tier has it, else copy it to host (or disk), then free it
    host full -> unpinned host slots in the host's order (the placement policy's, policy.placement):
                 drop it if the disk has it, else copy it to disk first (next round uses the slot)
    disk full -> the disk tier deletes entries itself, in its order (the placement policy's; under remote
                 write_back it shows them to the remote writer first: RemoteWriter.disk_victims)

Where the placement policy carries use counts, each copy down brings the
block's use count to the tier it enters (``Tier.seed_uses``). With exclusive tiers the
cascade is the same: a loaded block has no lower copy left (the prefetcher
removes them), so its GPU eviction copies it to host again.

A block being copied holds an extra GPU reference (or a host pin) so nobody
reuses it mid-copy, and stays in the index, so lookups keep finding it.

Write policies decide when committed blocks are copied down before any
eviction: ``write_through`` at commit, ``write_through_selective`` once a
block was hit ``selective_hits`` times, ``write_back`` only on eviction.
Write-downs run on a worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvstore.config.schema import PolicyConfig
from kvstore.errors import BlockStateError
from kvstore.hierarchy import Hierarchy
from kvstore.host_slot import HostSlot
from kvstore.radix import BlockEntry
from kvstore.transfer import copy_bytes, staging_buffer

log = logging.getLogger("kvstore.spill")


@dataclass
class _Move:
    """One copy an eviction round does outside the lock."""

    key: bytes
    entry: BlockEntry | None
    gpu_block: int | None = None
    """GPU source (the round holds a reference on it)."""
    host_src: HostSlot | None = None
    """Pinned host source (a host victim going to disk)."""
    host_dst: HostSlot | None = None
    """Reserved host destination of a GPU victim (``None`` with a GPU source: straight to disk)."""
    ok: bool = False
    uses: int | None = None
    """The block's use count when the move was planned (:meth:`Placement.uses_of`), if counts are carried."""


class Spiller:
    """Evicts and writes blocks down the hierarchy for one :class:`Hierarchy`."""

    def __init__(self, h: Hierarchy, policy: PolicyConfig) -> None:
        self.h = h
        self.policy = policy
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-writedown")
        self._pending: set[Future[None]] = set()

    # ------------------------------------------------------------ GPU side
    def make_gpu_room(self, n: int) -> int:
        """Evict cached blocks nobody else holds until ``n`` GPU blocks are free (or nothing more can go).

        Call without holding the lock: copies down run outside it. Returns the free count.
        """
        h = self.h
        while True:
            with h.lock:
                if h.pool.num_free >= n:
                    return h.pool.num_free
                moves = self._choose_gpu_victims(n)
                if not moves:
                    return h.pool.num_free
            self._copy(moves)
            with h.lock:
                self._publish(moves)

    def _choose_gpu_victims(self, n: int) -> list[_Move]:
        """Free GPU victims that need no copy until ``n`` blocks are free; plan copies for the rest (under the lock)."""
        h, pl = self.h, self.h.placement
        moves: list[_Move] = []
        planned = 0
        while h.pool.num_free + planned < n:
            entry = pl.oldest_gpu()
            if entry is None:
                break
            b = entry.gpu_block
            assert b is not None
            pl.adopt_host_copy(entry)
            if entry.host_slot is not None or entry.on_disk:
                pl.unindex_gpu(entry)
                self._count_gpu_eviction(entry.key)
                continue
            dst: HostSlot | None = None
            if h.host is not None:
                dst, host_moves = self._host_slot(entry.key)
                if dst is None and host_moves:
                    moves.extend(host_moves)  # copy host victims down first; this block goes next round
                    break
            if dst is None and h.disk is None:
                pl.drop_from(entry)  # nowhere to keep it: the block and its extensions leave the index (handed down first)
                h.counters.gpu_evictions += 1
                continue
            pl.ref([b])  # held until the copy is published; out of the eviction queue meanwhile
            moves.append(_Move(entry.key, entry, gpu_block=b, host_dst=dst, uses=pl.uses_of(entry.key)))
            planned += 1
        return moves

    def _count_gpu_eviction(self, key: bytes) -> None:
        self.h.counters.gpu_evictions += 1
        self.h.events.put("evicted", key, "gpu")

    def _host_slot(self, key: bytes) -> tuple[HostSlot | None, list[_Move]]:
        """A reserved host slot for ``key`` now, else the host victims to copy to disk to make one."""
        pl = self.h.placement
        try:
            slot = pl.reserve_host(key)
        except BlockStateError:
            return None, []  # another load reserved the same block: go straight to disk
        if slot is not None:
            return slot, []
        return None, self._choose_host_victims(1)

    # ----------------------------------------------------------- host side
    def make_host_room(self, n: int) -> int:
        """Free up to ``n`` host slots, in the host's eviction order, copying each to disk first if needed.

        Call without holding the lock. Returns how many slots were freed.
        """
        h, pl = self.h, self.h.placement
        assert h.host is not None
        freed = 0
        while freed < n:
            with h.lock:
                moves: list[_Move] = []
                for key in h.host.victims(n - freed):
                    entry = h.index.get(key)
                    if h.disk is None or (entry is not None and entry.on_disk):
                        freed += pl.evict_host(key)
                    else:
                        moves.extend(self._choose_host_victims_for([key]))
                if not moves:
                    return freed
            self._copy(moves)
            with h.lock:
                freed += self._publish(moves)
        return freed

    def ensure_host_free(self, n: int) -> None:
        """Make ``n`` host slots free if the tier has fewer (copies outside the lock; call without it)."""
        host = self.h.host
        if host is not None and host.num_free_slots < n:
            self.make_host_room(n - host.num_free_slots)

    def _choose_host_victims(self, n: int) -> list[_Move]:
        h = self.h
        assert h.host is not None
        return self._choose_host_victims_for(h.host.victims(n))

    def _choose_host_victims_for(self, keys: Sequence[bytes]) -> list[_Move]:
        pl = self.h.placement
        moves = []
        for key in keys:
            src = pl.pin_host(key, use=False)  # a victim copied down: not a use
            if src is not None:
                moves.append(_Move(key, self.h.index.get(key), host_src=src, uses=pl.uses_of(key)))
        return moves

    # -------------------------------------------------------- copy, publish
    def _copy(self, moves: list[_Move]) -> None:
        """Do the planned copies (outside the lock); each move records whether it worked."""
        h, pl = self.h, self.h.placement
        for mv in moves:
            try:
                if mv.host_src is not None:
                    assert h.disk is not None
                    mv.ok = h.disk.put([mv.key], [pl.view(mv.host_src)])[0]
                    self._seed_disk(mv)
                    continue
                assert mv.gpu_block is not None
                src = h.pool.block_bytes(mv.gpu_block)
                if mv.host_dst is not None:
                    copy_bytes(pl.view(mv.host_dst), src)
                    mv.ok = True
                else:
                    assert h.disk is not None
                    data = src if src.device.type == "cpu" else copy_bytes(staging_buffer(h.layout, pin=False), src)
                    mv.ok = h.disk.put([mv.key], [data])[0]
                    self._seed_disk(mv)
            except Exception:  # noqa: BLE001 - the move is published as failed; the block is not lost silently
                log.exception("copying block %s down failed", mv.key.hex()[:16])
                mv.ok = False

    def _seed_disk(self, mv: _Move) -> None:
        """After a copy to disk (outside the lock), bring the block's use count to the disk's order."""
        if mv.ok and mv.uses is not None:
            assert self.h.disk is not None
            self.h.disk.seed_uses([mv.key], [mv.uses])

    def _publish(self, moves: list[_Move]) -> int:
        """Record the copies and free what they replaced (under the lock); returns host slots freed."""
        h, pl = self.h, self.h.placement
        freed = 0
        for mv in moves:
            if mv.host_src is not None:  # a host victim
                if mv.ok:
                    self._count_spill(mv.key, "disk", "spilled")
                pl.release(mv.host_src)
                freed += pl.evict_host(mv.key)
                continue
            b, entry = mv.gpu_block, mv.entry
            assert b is not None and entry is not None
            if mv.host_dst is not None:
                pl.publish(mv.host_dst)
                pl.release(mv.host_dst)
                self._count_spill(mv.key, "host", "spilled")
            elif mv.ok:
                self._count_spill(mv.key, "disk", "spilled")
            if entry.gpu_block == b and h.pool.ref_count(b) == 2:  # the index and this round only
                if entry.host_slot is not None or entry.on_disk:
                    pl.unindex_gpu(entry)
                    self._count_gpu_eviction(mv.key)
                else:
                    pl.drop_from(entry)  # the copy failed: the block and its extensions leave
                    h.counters.gpu_evictions += 1
            pl.unref([b])
        return freed

    def _count_spill(self, key: bytes, tier: str, kind: str) -> None:
        h = self.h
        if tier == "disk":
            h.placement.mark_on_disk(key)
        h.counters.spilled_blocks[tier] += 1
        h.events.put(kind, key, tier)  # type: ignore[arg-type]

    # -------------------------------------------------------- write policy
    @property
    def takes_commits(self) -> bool:
        """Whether :meth:`on_commit` does anything (write-through with a tier below the GPU). Changes nothing."""
        return self.policy.write == "write_through" and (self.h.host is not None or self.h.disk is not None)

    def on_commit(self, entries: Sequence[BlockEntry]) -> None:
        """Apply the write policy to freshly committed blocks (call without the lock)."""
        if self.policy.write == "write_through":
            self.write_down(entries)

    def due_on_hit(self, entries: Sequence[BlockEntry]) -> list[BlockEntry]:
        """Blocks a lookup just matched that the write policy wants copied down now. Changes nothing."""
        if self.policy.write != "write_through_selective":
            return []
        return [e for e in entries if e.hits >= self.policy.selective_hits]

    def write_down(self, entries: Sequence[BlockEntry]) -> None:
        """Schedule copies of GPU-resident blocks to every lower tier that lacks them (call without the lock)."""
        h = self.h
        if h.host is None and h.disk is None:
            return  # nowhere to copy to: skip the per-block pass (a 128k-token commit has 8192 blocks)
        todo: list[tuple[BlockEntry, int]] = []
        with h.lock:
            for e in entries:
                needs = (h.host is not None and e.host_slot is None) or (h.disk is not None and not e.on_disk)
                if e.gpu_block is not None and e.node is not None and needs:
                    h.placement.ref([e.gpu_block])  # held until the copy is done
                    todo.append((e, e.gpu_block))
        if todo:
            fut = self._writer.submit(self._write_down_job, todo)
            self._pending.add(fut)
            fut.add_done_callback(self._pending.discard)

    def _write_down_job(self, todo: list[tuple[BlockEntry, int]]) -> None:
        for entry, block in todo:
            try:
                self._write_down_one(entry, block)
            finally:
                with self.h.lock:
                    self.h.placement.unref([block])

    def _write_down_one(self, entry: BlockEntry, block: int) -> None:
        """Copy one block to the host tier (if it lacks it), then to disk from there. Locks only to choose and publish."""
        h, pl = self.h, self.h.placement
        src = h.pool.block_bytes(block)
        held: HostSlot | None = None
        dst: HostSlot | None = None
        with h.lock:
            if entry.node is None:
                return  # left the index meanwhile
            if h.host is not None:
                pl.adopt_host_copy(entry)
                if entry.host_slot is not None:
                    held = pl.pin_host(entry.key, use=False)  # the disk copy below reads it (not a use)
                else:
                    try:
                        dst = pl.reserve_host(entry.key)
                    except BlockStateError:
                        dst = None  # another load is writing it
            need_disk = h.disk is not None and not entry.on_disk
        if dst is not None:
            try:
                copy_bytes(pl.view(dst), src)
            except BaseException:
                with h.lock:
                    pl.abort(dst)
                raise
            with h.lock:
                pl.publish(dst)
                self._count_spill(entry.key, "host", "stored")
            held = dst
        elif h.host is not None and held is None:
            log.debug("write-down of %s: no host slot free", entry.key.hex()[:16])
        try:
            if need_disk:
                assert h.disk is not None
                data: torch.Tensor
                if held is not None:
                    data = pl.view(held)
                else:
                    data = src if src.device.type == "cpu" else copy_bytes(staging_buffer(h.layout, pin=True), src)
                if h.disk.put([entry.key], [data])[0]:
                    with h.lock:
                        self._count_spill(entry.key, "disk", "stored")
                        uses = pl.uses_of(entry.key)
                    if uses is not None:
                        h.disk.seed_uses([entry.key], [uses])
        finally:
            if held is not None:
                with h.lock:
                    pl.release(held)

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
