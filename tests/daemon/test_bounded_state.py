"""Nothing in the daemon grows with the number of blocks that went through it.

Tier eviction events used to pile up in an unbounded list nobody drained (about 1 MB/s in a soak);
the multi-minute soak benchmark is ``kvstore bench soak``, these are the bounded checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemonlib import LAYOUT, block_for, keys_for
from faultydisk import faulty_backend
from kvstore.tiers import base
from kvstore.tiers.host.tier import HostTier


def test_many_put_evict_cycles_leave_no_queued_events_or_state(tmp_path: Path) -> None:
    backend, disk = faulty_backend(tmp_path, slots=16, disk_bytes=1 << 20)
    try:
        keys = keys_for(1600, seed=11)
        for i in range(0, len(keys), 4):
            batch = keys[i : i + 4]
            assert backend.put_inline(batch, [memoryview(block_for(k).numpy()) for k in batch]) == [True] * 4
            backend.writer.drain()  # slots queued for disk are locked; let them go before the next batch
            owner = i % 5  # holds of several owners, each ended by RELEASE
            slots = backend.hold_for_read(owner, batch[:2])
            assert backend.release(owner, [k for k, s in zip(batch[:2], slots) if s is not None]) == 2
            backend.read_inline(keys[max(0, i - 40) : i])  # disk hits come back into host, evicting again
        backend.flush()
        host_stats, disk_stats = backend.host.stats(), disk.inner.stats()
        assert host_stats.evictions > 1200 and disk_stats.evictions > 200  # the cycles really happened
        assert backend.host.drain_events() == [] and disk.inner.drain_events() == []
        assert backend.host.events_queued == 0 and backend.host.events_dropped == 0
        assert len(backend.holds) == 0 and backend.writer.pending == 0
        assert not any(backend.writer.is_pending(k) for k in keys)
    finally:
        backend.close()


def test_an_undrained_tier_keeps_at_most_its_bound_of_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "MAX_QUEUED_EVENTS", 16)
    tier = HostTier(LAYOUT, 4 * LAYOUT.bytes_per_block, pin_memory="never")
    try:
        keys = keys_for(100, seed=12)
        for key in keys:
            tier.put([key], [block_for(key)])
        assert tier.events_queued == 16 and tier.events_dropped == 100 - 4 - 16
        assert [e.key for e in tier.drain_events()] == keys[80:96]  # the newest 16 evictions, oldest first
        tier.record_events(False)
        tier.put(keys[:8], [block_for(k) for k in keys[:8]])
        assert tier.events_queued == 0
    finally:
        tier.close()


def test_events_of_a_batch_eviction_are_bounded_and_counted_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "MAX_QUEUED_EVENTS", 16)
    tier = HostTier(LAYOUT, 4 * LAYOUT.bytes_per_block, pin_memory="never")
    try:
        keys = keys_for(100, seed=13)
        for i in range(0, 100, 4):  # each batch evicts the previous one's 4 blocks in one pass
            tier.put(keys[i : i + 4], [block_for(k) for k in keys[i : i + 4]])
        assert tier.stats().evictions == 96 and set(tier.keys()) == set(keys[96:])
        assert tier.events_queued == 16 and tier.events_dropped == 96 - 16
        assert {e.key for e in tier.drain_events()} == set(keys[80:96])  # the newest 16 evictions
    finally:
        tier.close()
