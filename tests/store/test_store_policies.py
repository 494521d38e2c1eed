"""Exact behaviour of each write policy and each prefetch stop policy; no deadlock on a locked host."""

from __future__ import annotations

import threading
import time

import torch

from storelib import LAYOUT, MemoryTier, make_store, prefill, read_lease

BS = LAYOUT.block_size


def toks(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * BS))


def _where(s, t):  # noqa: ANN001, ANN202
    s.spiller.wait()  # the scheduled write-downs only: a flush writes every block down under every policy
    with s.lock:
        return [(e.gpu_block is not None, e.host_slot is not None, e.on_disk) for e in s.index.match_keys(s.keys(t), count_hits=False).entries]


# ----------------------------------------------------------------------------- write policies


def test_write_through_copies_down_at_commit() -> None:
    disk = MemoryTier(LAYOUT)
    s = make_store(disk=disk, write="write_through")
    prefill(s, toks(0, 2))
    assert _where(s, toks(0, 2)) == [(True, True, True)] * 2
    assert len(disk.data) == 2
    kinds = [(e.kind, e.tier) for e in s.drain_events()]
    assert kinds.count(("stored", "host")) == 2 and kinds.count(("stored", "disk")) == 2


def test_write_back_copies_down_only_on_eviction() -> None:
    disk = MemoryTier(LAYOUT)
    s = make_store(gpu_blocks=4, host_blocks=2, disk=disk, write="write_back")
    prefill(s, toks(0, 2))
    assert _where(s, toks(0, 2)) == [(True, False, False)] * 2
    assert len(disk.data) == 0
    prefill(s, toks(100, 2))
    prefill(s, toks(200, 2))  # evicts toks(0) from GPU: to host only
    assert _where(s, toks(0, 2)) == [(False, True, False)] * 2
    assert len(disk.data) == 0
    prefill(s, toks(300, 2))  # evicts toks(100) to host, which pushes toks(0) to disk
    assert _where(s, toks(0, 2)) == [(False, False, True)] * 2
    assert len(disk.data) == 2
    s.flush()  # what only the GPU (toks 200, 300) or host (toks 100) holds goes straight to disk, not through host
    assert [_where(s, toks(t, 2)) for t in (100, 200, 300)] == [[(False, True, True)] * 2] + [[(True, False, True)] * 2] * 2
    assert len(disk.data) == 8


def test_write_through_selective_after_n_hits() -> None:
    disk = MemoryTier(LAYOUT)
    s = make_store(disk=disk, write="write_through_selective", selective_hits=2)
    prefill(s, toks(0, 2))
    assert _where(s, toks(0, 2)) == [(True, False, False)] * 2
    s.lookup(toks(0, 2))  # first hit
    assert _where(s, toks(0, 2)) == [(True, False, False)] * 2
    s.lookup(toks(0, 1))  # second hit for block 0 only
    assert _where(s, toks(0, 2)) == [(True, True, True), (True, False, False)]
    s.lookup(toks(0, 2))
    assert _where(s, toks(0, 2)) == [(True, True, True)] * 2
    assert len(disk.data) == 2


# ------------------------------------------------------------------------- stop policies


def _disk_only_store(delay_s: float, **policy: object):  # noqa: ANN202
    disk = MemoryTier(LAYOUT)
    writer = make_store(disk=disk, write="write_through")
    data = prefill(writer, toks(0, 8), seed=9)
    writer.flush()
    disk.delay_s = delay_s
    return make_store(gpu_blocks=16, host_blocks=16, disk=disk, **policy), data


def test_wait_complete_loads_everything() -> None:
    s, data = _disk_only_store(0.01, prefetch="wait_complete")
    got, lease = read_lease(s, toks(0, 8))
    assert lease.num_cached_tokens == 8 * BS and lease.shortfall is None  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(got, data))


def test_best_effort_starts_with_what_arrived() -> None:
    s, data = _disk_only_store(0.05, prefetch="best_effort")
    m = s.lookup(toks(0, 8))
    lease = s.acquire(m)
    n = lease.resolve()  # immediately: no disk block has arrived yet
    assert n == 0 and "best_effort" in (lease.shortfall or "")
    lease.wait()
    s.release(lease)  # does not wait for the reads it dropped: they give their blocks back when they return
    assert lease.reads_done(5)  # type: ignore[attr-defined]
    s.check_integrity()
    assert s.pool.num_used == 0
    # Nothing half-loaded was published: a fresh wait_complete read still returns exact data.
    s.policy.prefetch = "wait_complete"
    got, _ = read_lease(s, toks(0, 8))
    assert all(torch.equal(a, b) for a, b in zip(got, data))


def test_timeout_recomputes_the_rest() -> None:
    # 8 blocks at 40 ms each (one get per batch of up to 32 blocks: 320 ms) vs a 50 ms budget.
    s, _ = _disk_only_store(0.04, prefetch="timeout", prefetch_timeout_base_ms=50, prefetch_timeout_per_1k_tokens_ms=0)
    t0 = time.perf_counter()
    lease = s.acquire(s.lookup(toks(0, 8)))
    n = lease.resolve()
    assert n < 8 * BS and "timeout" in (lease.shortfall or "")
    s.release(lease)
    assert time.perf_counter() - t0 < 5
    # A generous budget loads everything.
    s2, _ = _disk_only_store(0.001, prefetch="timeout", prefetch_timeout_base_ms=10_000)
    lease2 = s2.acquire(s2.lookup(toks(0, 8)))
    assert lease2.resolve() == 8 * BS
    s2.release(lease2)


def test_timeout_budget_grows_with_prefix_length() -> None:
    s = make_store(prefetch="timeout", prefetch_timeout_base_ms=20, prefetch_timeout_per_1k_tokens_ms=5)
    from kvstore.store.prefetch import BlockPlan, StoreLease

    plan = [BlockPlan(bytes(32), "disk", 0)] * 500  # 2000 tokens
    lease = StoreLease((), plan, None, BS, LAYOUT.num_layers)
    assert abs(s.prefetcher.timeout_s(lease) - (0.020 + 0.005 * 2)) < 1e-9


def test_host_full_of_locked_blocks_loads_fewer_without_deadlock() -> None:
    disk = MemoryTier(LAYOUT)
    writer = make_store(disk=disk, write="write_through")
    prefill(writer, toks(0, 4), seed=3)
    writer.flush()
    s = make_store(gpu_blocks=16, host_blocks=2, disk=disk, write="write_through")
    prefill(s, toks(500, 2), seed=4)  # fill the host tier (write_through) ...
    s.flush()
    assert s.h.host is not None
    locked = [e.key for e in s.index.match_keys(s.keys(toks(500, 2)), count_hits=False).entries]
    s.h.host.pin(locked)  # ... and pin every slot
    done = threading.Event()
    result: dict[str, object] = {}

    def run() -> None:
        lease = s.acquire(s.lookup(toks(0, 4)))
        result["n"] = lease.resolve()
        result["why"] = lease.shortfall
        lease.wait()
        s.release(lease)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(10), "prefetch deadlocked on a host tier full of pinned blocks"
    assert result["n"] == 0 and "host tier full of pinned blocks" in str(result["why"])
    s.h.host.unpin(locked)
    s.check_integrity()
    # Unlocked, the two slots are reused: disk blocks go through host slots, so at most two load at once.
    got, lease = read_lease(s, toks(0, 4))
    assert lease.num_cached_tokens == 2 * BS  # type: ignore[attr-defined]
    assert "host tier full" in str(lease.shortfall)  # type: ignore[attr-defined]
    s.check_integrity()


def test_per_layer_readiness_and_cancellation() -> None:
    s, data = _disk_only_store(0.0)
    # Move the prefix to host so phase 2 has real copies to do, layer by layer.
    got, _ = read_lease(s, toks(0, 8))
    lease = s.acquire(s.lookup(toks(0, 8)))
    lease.resolve()
    for layer in range(LAYOUT.num_layers):
        lease.wait_layer(layer)
        for b, d in zip(lease.block_ids, data):
            assert torch.equal(s.pool.block(b)[layer], d[layer])
    s.release(lease)
    # Release without resolve cancels and gives every reference back.
    used = s.pool.num_used
    lease = s.acquire(s.lookup(toks(0, 8)))
    s.release(lease)
    assert s.pool.num_used == used
    s.check_integrity()


def test_inflight_bytes_bound_applies_backpressure() -> None:
    disk = MemoryTier(LAYOUT)
    writer = make_store(disk=disk, write="write_through")
    for i in range(4):
        prefill(writer, toks(1000 * i, 4), seed=i)
    writer.flush()
    disk.delay_s = 0.01
    s = make_store(gpu_blocks=32, host_blocks=32, disk=disk, max_inflight_bytes=LAYOUT.bytes_per_block)
    leases = [s.acquire(s.lookup(toks(1000 * i, 4))) for i in range(4)]
    assert [lease.resolve() for lease in leases] == [4 * BS] * 4
    for lease in leases:
        s.release(lease)
    assert s.prefetcher.budget.waits > 0 and s.prefetcher.budget.in_flight == 0
    s.check_integrity()
