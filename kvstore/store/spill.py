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

The write policy (:class:`~kvstore.lower.write_policy.WriteRule`, ``policy.write``) decides when committed
blocks are copied down before any eviction: ``write_through`` at commit, ``write_through_selective`` once a
block was hit ``selective_hits`` times, ``write_back`` only on eviction.
Write-downs run on a worker thread. An eviction round's copies to disk, and a write-down batch's, go in one put
where the disk tier takes batches (:data:`PUT_BYTES`), and a write-down batch takes the hierarchy lock a fixed
number of times, not a few times per block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvstore.config.schema import PolicyConfig
from kvstore.errors import BlockStateError
from kvstore.store.hierarchy import Hierarchy
from kvstore.store.host_slot import HostSlot
from kvstore.lower.write_policy import WriteRule
from kvstore.store.radix import BlockEntry
from kvstore.store.transfer import copy_bytes, staging_blocks

log = logging.getLogger("kvstore.spill")

PUT_BYTES = 64 << 20
"""Most bytes of blocks one put to the disk tier carries (fewer where the tier bounds its batches:
:attr:`Tier.max_put_blocks`). Blocks go down in batches, not one put each, where the tier takes them: a put to
the daemon tier costs a reserve and a commit round trip per batch of its own, so a put per block cost two round
trips per block. A batch's GPU sources are staged through one host buffer, which this bounds."""


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


@dataclass
class _Down:
    """One block of a write-down batch: from its GPU block to host (if the host lacks it), then to disk."""

    entry: BlockEntry
    block: int
    """Its GPU block (the write-down holds a reference on it)."""
    host: HostSlot | None = None
    """Its host copy: reserved when this batch writes it, pinned (published) when the disk copy may read it."""
    to_disk: bool = False
    uses: int | None = None
    """Its use count when planned (:meth:`Placement.uses_of`), if counts are carried and it goes to disk."""


class Spiller:
    """Evicts and writes blocks down the hierarchy for one :class:`Hierarchy`."""

    def __init__(self, h: Hierarchy, policy: PolicyConfig) -> None:
        self.h = h
        self.policy = policy
        self.rule = WriteRule.from_config(policy)
        """When a committed block is due to be copied down (``policy.write``)."""
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
        """Do the planned copies (outside the lock): into host slots one by one, to disk in one put for the round
        (:meth:`_put_down`); each move records whether it worked."""
        h, pl = self.h, self.h.placement
        down: list[_Move] = []
        srcs: list[torch.Tensor] = []
        for mv in moves:
            try:
                if mv.host_src is not None:  # a host victim
                    srcs.append(pl.view(mv.host_src))
                    down.append(mv)
                    continue
                assert mv.gpu_block is not None
                src = h.pool.block_bytes(mv.gpu_block)
                if mv.host_dst is None:  # a GPU victim straight to disk
                    srcs.append(src)
                    down.append(mv)
                    continue
                copy_bytes(pl.view(mv.host_dst), src)
                mv.ok = True
            except Exception:  # noqa: BLE001 - the move is published as failed; the block is not lost silently
                log.exception("copying block %s down failed", mv.key.hex()[:16])
        if not down:
            return
        try:
            stored = self._put_down([mv.key for mv in down], srcs, [mv.uses for mv in down], pin=False)
        except Exception:  # noqa: BLE001 - the moves are published as failed, as above
            log.exception("copying %d blocks to the disk tier failed", len(down))
            return
        for mv, ok in zip(down, stored):
            mv.ok = ok

    def _put_down(self, keys: list[bytes], srcs: list[torch.Tensor], uses: list[int | None], *, pin: bool) -> list[bool]:
        """Copy blocks to the disk tier (outside the lock), :data:`PUT_BYTES` per put, GPU sources staged through
        one host buffer per put (pinned when ``pin``); then bring each stored block's use count (``uses[i]``,
        ``None``: not carried) to the disk's order; fewer per put where the tier says so (:attr:`Tier.max_put_blocks`).
        ``result[i]``: the disk holds ``keys[i]``. Raises what the tier raises."""
        disk = self.h.disk
        assert disk is not None
        step = max(1, PUT_BYTES // self.h.layout.bytes_per_block)
        step = step if disk.max_put_blocks is None else min(step, disk.max_put_blocks)
        stored: list[bool] = []
        for i in range(0, len(keys), step):
            stored += disk.put(keys[i : i + step], _on_host(self.h, srcs[i : i + step], pin))
        seeded = [(k, u) for k, u, ok in zip(keys, uses, stored) if ok and u is not None]
        if seeded:
            disk.seed_uses([k for k, _ in seeded], [u for _, u in seeded])
        return stored

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
            if mv.host_dst is not None and mv.ok:
                pl.publish(mv.host_dst)
                pl.release(mv.host_dst)
                self._count_spill(mv.key, "host", "spilled")
            elif mv.host_dst is not None:
                pl.abort(mv.host_dst)  # the copy failed: nothing to publish
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
        return self.rule.at_commit and (self.h.host is not None or self.h.disk is not None)

    def on_commit(self, entries: Sequence[BlockEntry]) -> None:
        """Apply the write policy to freshly committed blocks (call without the lock)."""
        if self.rule.at_commit:
            self.write_down(entries)

    def due_on_hit(self, entries: Sequence[BlockEntry]) -> list[BlockEntry]:
        """Blocks a lookup just matched that the write policy wants copied down now. Changes nothing."""
        if not self.rule.counts_hits:
            return []
        return [e for e in entries if self.rule.due_on_hit(e.hits)]

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
        """Copy ``todo`` down in batches (:meth:`_write_down_batch`). Every block's reference is dropped, also when a
        batch fails; the error ends the job (:meth:`wait` raises it)."""
        step = self._write_down_blocks()
        start = 0
        try:
            for start in range(0, len(todo), step):
                self._write_down_batch(todo[start : start + step])
        except BaseException:
            with self.h.lock:
                self.h.placement.unref([b for _, b in todo[start + step :]])  # the failed batch dropped its own
            raise

    def _write_down_blocks(self) -> int:
        """Blocks per write-down batch: :data:`PUT_BYTES` of them, and with a host tier at most a quarter of its
        slots. A batch holds a host slot per block until its disk copy is done, and a reservation makes room only
        by dropping blocks already on disk: a batch larger than the host can place would send its rest to disk
        straight from the GPU, where block after block each found a slot (the previous ones, on disk by then)."""
        n = max(1, PUT_BYTES // self.h.layout.bytes_per_block)
        host = self.h.host
        return n if host is None else max(1, min(n, host.num_slots // 4))

    def _write_down_batch(self, todo: list[tuple[BlockEntry, int]]) -> None:
        """Copy GPU blocks to host where it lacks them, then those the disk lacks to disk in one put (from the host
        copy where there is one). Takes the lock three times whatever the batch's size (plan, publish the host
        copies, record the disk copies and let go), twice without host copies to publish; drops the batch's
        GPU references."""
        h, pl = self.h, self.h.placement
        plan: list[_Down] = []
        stored: list[_Down] = []
        try:
            with h.lock:
                self._plan_down(todo, plan)
            self._fill_host(plan)
            stored = self._disk_down(plan)
        finally:
            with h.lock:
                for d in stored:
                    self._count_spill(d.entry.key, "disk", "stored")
                for d in plan:
                    if d.host is not None and d.host.state == "pinned":
                        pl.release(d.host)
                    elif d.host is not None and d.host.state == "reserved":
                        pl.abort(d.host)  # planned, never filled: the batch failed before
                pl.unref([b for _, b in todo])

    def _plan_down(self, todo: list[tuple[BlockEntry, int]], plan: list[_Down]) -> None:
        """Under the lock: per block still indexed (a key named twice counts once), pin its host copy for the disk
        copy to read, or reserve a host slot to write it into; note whether the disk lacks it. Appends to ``plan``
        as it goes, so the caller gives back what was taken before an error."""
        h, pl = self.h, self.h.placement
        seen: set[bytes] = set()
        for entry, block in todo:
            if entry.node is None or entry.key in seen:
                continue  # left the index meanwhile, or already in this batch
            seen.add(entry.key)
            d = _Down(entry, block)
            plan.append(d)
            if h.host is not None:
                pl.adopt_host_copy(entry)
                if entry.host_slot is not None:
                    d.host = pl.pin_host(entry.key, use=False)  # the disk copy below reads it (not a use)
                else:
                    try:
                        d.host = pl.reserve_host(entry.key)
                    except BlockStateError:
                        pass  # another load is writing it
                    if d.host is None:
                        log.debug("write-down of %s: no host slot free", entry.key.hex()[:16])
            d.to_disk = h.disk is not None and not entry.on_disk
            d.uses = pl.uses_of(entry.key) if d.to_disk else None

    def _fill_host(self, plan: list[_Down]) -> None:
        """Copy the blocks whose host slots were reserved from the GPU (outside the lock), then publish them under
        one lock. A copy that fails aborts its reservation and those not yet copied, and raises."""
        h, pl = self.h, self.h.placement
        fills = [d for d in plan if d.host is not None and d.host.state == "reserved"]
        if not fills:
            return
        copied = 0
        try:
            for d in fills:
                assert d.host is not None
                copy_bytes(pl.view(d.host), h.pool.block_bytes(d.block))
                copied += 1
        finally:
            with h.lock:
                for i, d in enumerate(fills):
                    assert d.host is not None
                    if i < copied:
                        pl.publish(d.host)  # pinned now, for the disk copy; released with the batch
                        self._count_spill(d.entry.key, "host", "stored")
                    else:
                        pl.abort(d.host)
                        d.host = None

    def _disk_down(self, plan: list[_Down]) -> list[_Down]:
        """Copy the planned blocks the disk lacks to it (outside the lock), in one put; returns those it stored."""
        down = [d for d in plan if d.to_disk]
        if not down:
            return []
        h, pl = self.h, self.h.placement
        srcs = [pl.view(d.host) if d.host is not None else h.pool.block_bytes(d.block) for d in down]
        stored = self._put_down([d.entry.key for d in down], srcs, [d.uses for d in down], pin=True)
        return [d for d, ok in zip(down, stored) if ok]

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


def _on_host(h: Hierarchy, srcs: list[torch.Tensor], pin: bool) -> list[torch.Tensor]:
    """``srcs`` readable by the CPU: those on the GPU copied into one staging buffer (pinned when ``pin``), the
    others as they are."""
    on_gpu = [i for i, s in enumerate(srcs) if s.device.type != "cpu"]
    if not on_gpu:
        return srcs
    buf = staging_blocks(h.layout, len(on_gpu), pin)
    out = list(srcs)
    for row, i in enumerate(on_gpu):
        out[i] = copy_bytes(buf[row], srcs[i])
    return out
