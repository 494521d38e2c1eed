"""One placement owner. No phantom hits, O(1) GPU victims, no I/O under the store lock."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from kvstore.errors import BlockStateError, PlacementError
from kvstore.store.radix import RadixIndex
from kvstore.tiers.base import Buffer

from storelib import LAYOUT, MemoryTier, make_store, prefill, read_lease

BS = LAYOUT.block_size


def toks(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * BS))


class SilentTier(MemoryTier):
    """A daemon-like tier: it drops blocks behind the store's back and announces nothing."""

    reports_evictions = False

    def forget_all(self) -> None:
        with self._lock:
            self.data.clear()


# ----------------------------------------------------------------------------- defect 2: phantom hits


def test_tier_without_events_is_asked_so_evicted_blocks_are_never_hits() -> None:
    disk = SilentTier(LAYOUT)
    s = make_store(gpu_blocks=8, host_blocks=None, disk=disk, write="write_back")
    prefill(s, toks(0, 4))
    assert s.offload("gpu") == 4
    assert s.lookup(toks(0, 4)).tiers == ("disk",) * 4  # really there: a hit
    disk.forget_all()  # the daemon evicted them and sent no event
    for _ in range(3):
        m = s.lookup(toks(0, 4))
        assert m.num_blocks == 0, m.tiers
    st = s.stats()
    assert st["disk"]["hit_tokens"] == 4 * BS  # the one real hit; none for the three phantom lookups
    assert st["miss_tokens"] == 3 * 4 * BS
    data, lease = read_lease(s, toks(0, 4))
    assert data == [] and lease.num_cached_tokens == 0  # type: ignore[attr-defined]
    s.check_integrity()


def test_failed_load_clears_the_record_like_an_eviction() -> None:
    disk = MemoryTier(LAYOUT)  # reports evictions, but loses these blocks silently (a bug, a corrupt file)
    s = make_store(gpu_blocks=8, host_blocks=None, disk=disk, write="write_back")
    prefill(s, toks(0, 4))
    s.offload("gpu")
    with disk._lock:
        disk.data.clear()
    assert s.lookup(toks(0, 4)).tiers == ("disk",) * 4  # trusted once ...
    data, lease = read_lease(s, toks(0, 4))
    assert lease.num_cached_tokens == 0 and "disk tier returned 0 of 4" in str(lease.shortfall)  # type: ignore[attr-defined]
    for _ in range(3):  # ... and never again: the failed load went through the eviction path
        assert s.lookup(toks(0, 4)).num_blocks == 0
    assert s.stats()["disk"]["hit_tokens"] == 2 * 4 * BS  # the lookups before the load (mine, read_lease's) only
    assert len(s.index) == 0
    s.check_integrity()


# ----------------------------------------------------------------------------- defect 3: O(1) victims


def test_gpu_eviction_queue_is_exact_lru_of_blocks_only_the_cache_holds() -> None:
    s = make_store(gpu_blocks=6, host_blocks=8, write="write_back")
    prefill(s, toks(0, 2))
    prefill(s, toks(100, 2))
    prefill(s, toks(200, 2))
    a = [e.gpu_block for e in s.lookup(toks(0, 2)).entries]  # a becomes most recent, its head last
    b = [e.gpu_block for e in s.lookup(toks(100, 2)).entries]
    c = [e.gpu_block for e in s.lookup(toks(200, 2), salt=None).entries]
    order = s.h.placement.gpu_lru.order()
    assert order == [a[1], a[0], b[1], b[0], c[1], c[0]]
    lease = s.acquire(s.lookup(toks(0, 2)))  # held by a request: not evictable
    assert s.h.placement.gpu_lru.order() == [b[1], b[0], c[1], c[0]]
    s.release(lease)  # back, most recent, tail first
    assert s.h.placement.gpu_lru.order() == [b[1], b[0], c[1], c[0], a[1], a[0]]
    own = s.allocate(1)
    assert s.lookup(toks(100, 2)).tiers == ("gpu", "host")  # the oldest (b's tail) went first
    s.free(own)
    s.check_integrity()


def test_choosing_a_gpu_victim_never_walks_lower_tier_only_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_store(gpu_blocks=4, host_blocks=400, write="write_back")
    for i in range(300):  # 300 host-only nodes, each pushed out of the GPU by the next prompts
        prefill(s, toks(1000 * i, 1))
    assert s.stats()["gpu"]["cached_blocks"] == 4
    visits = [0]

    def counting_depth(node: object) -> int:
        visits[0] += 1
        return 0

    def no_walk(*_: object) -> None:
        raise AssertionError("GPU victim selection walked the radix tree")

    monkeypatch.setattr(RadixIndex, "depth", staticmethod(counting_depth))
    monkeypatch.setattr(RadixIndex, "iter_lru", no_walk, raising=False)  # the tree walk it used to do
    monkeypatch.setattr(RadixIndex, "nodes", no_walk)
    own = s.allocate(4)  # evicts every cached GPU block
    assert visits[0] == 0
    monkeypatch.undo()
    assert s.stats()["gpu"]["cached_blocks"] == 0
    s.free(own)
    s.check_integrity()


# ----------------------------------------------------------------------------- defect 4: no I/O under the lock


class BlockingTier(MemoryTier):
    """A disk whose put blocks until :attr:`go` is set (a slow fsync, a stalled daemon)."""

    def __init__(self) -> None:
        super().__init__(LAYOUT)
        self.entered = threading.Event()
        self.go = threading.Event()

    def put(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        self.entered.set()
        assert self.go.wait(10), "test never released the put"
        return super().put(keys, srcs)


@pytest.mark.parametrize("host_blocks", [None, 2])
def test_lookup_and_allocate_proceed_while_a_spill_blocks_on_disk(host_blocks: int | None) -> None:
    disk = BlockingTier()
    s = make_store(gpu_blocks=6, host_blocks=host_blocks, disk=disk, write="write_back")
    if host_blocks:
        prefill(s, toks(500, 2))  # these will be the host victims that must go to disk
        s.offload("gpu")
    prefill(s, toks(0, 2))
    prefill(s, toks(100, 2))
    spiller = threading.Thread(target=lambda: s.offload("gpu" if host_blocks is None else "host"), daemon=True)
    spiller.start()
    assert disk.entered.wait(5)
    done = threading.Event()

    def other_request() -> None:
        m = s.lookup(toks(100, 2))
        lease = s.acquire(m)
        lease.resolve()
        s.release(lease)
        s.free(s.allocate(1))
        s.stats()
        done.set()

    threading.Thread(target=other_request, daemon=True).start()
    finished = done.wait(5)
    disk.go.set()
    spiller.join(10)
    assert finished, "a lookup/allocate waited for a disk put: I/O under the store lock"
    assert not spiller.is_alive()
    s.check_integrity()


def test_store_lock_is_not_reentrant() -> None:
    s = make_store()
    with s.lock:
        assert not s.lock.acquire(blocking=False)


# ----------------------------------------------------------------------------- placement transitions


def test_host_slot_handles_release_exactly_once_and_transitions_check_state() -> None:
    s = make_store(gpu_blocks=4, host_blocks=4, write="write_back")
    pl = s.h.placement
    with s.lock:
        slot = pl.reserve_host(b"k" * 32)
        assert slot is not None
        with pytest.raises(PlacementError, match="not pinned"):
            pl.release(slot)  # a reservation is aborted or published, not released
        pl.publish(slot)
        with pytest.raises(PlacementError, match="not reserved"):
            pl.publish(slot)
        pl.release(slot)
        with pytest.raises(PlacementError, match="released twice"):
            pl.release(slot)
        with pytest.raises(BlockStateError):
            pl.reserve_host(b"k" * 32)  # published already
        assert s.h.host is not None and s.h.host.num_pinned == 0
    prefill(s, toks(0, 1))
    with s.lock:
        entry = s.index.get(s.keys(toks(0, 1))[0])
        assert entry is not None and entry.gpu_block is not None
        with pytest.raises(PlacementError, match="already in GPU block"):
            pl.index_gpu(entry, 3)
    s.check_integrity()


# ------------------------------------------------------ a disk eviction that overtakes a publish


def test_a_disk_copy_evicted_before_its_publish_is_never_recorded() -> None:
    """The spiller records a disk copy after its put returns; a put of other blocks may evict it (and a
    lookup apply that eviction) first. The late record must not bring a copy that is gone back."""
    disk = MemoryTier(LAYOUT, capacity_blocks=2)
    s = make_store(gpu_blocks=8, host_blocks=None, disk=disk, write="write_back")
    prefill(s, toks(0, 1))
    key = s.keys(toks(0, 1))[0]
    entry = s.index.get(key)
    assert entry is not None and entry.gpu_block is not None and not entry.on_disk
    block = s.pool.block_bytes(entry.gpu_block)
    assert disk.put([key], [block]) == [True]  # the spiller's put returned ...
    disk.put([b"x" * 32, b"y" * 32], [block, block])  # ... another put evicted it ...
    assert s.lookup(toks(0, 1)).tiers == ("gpu",)  # ... and a lookup applied the eviction
    with s.lock:
        s.h.placement.mark_on_disk(key)  # the late publish
    assert not entry.on_disk
    s.check_integrity()
    assert s.offload("gpu") == 1 and disk.contains(key)  # its next eviction from the GPU copies it down again
    with s.lock:
        assert entry.on_disk  # and that publish is recorded: the loss was remembered once
    s.check_integrity()
