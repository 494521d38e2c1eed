"""The eviction cascade on real tiers: every block stays reachable until the disk cap drops it."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.config.schema import PolicyConfig
from kvstore.gpu_pool import GPUBlockPool
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from storelib import LAYOUT, fill_keyed

BS = LAYOUT.block_size


def _store(root: Path, write: str, disk_cap: int) -> TieredStore:
    pool = GPUBlockPool(LAYOUT, 6, device="cpu")
    host = HostTier(LAYOUT, 5 * LAYOUT.bytes_per_block, auto_evict=False)
    disk = DiskTier(LAYOUT, root, disk_cap, sync="interval")
    return TieredStore(LAYOUT, pool, host, disk, PolicyConfig(write=write))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(st.tuples(st.sampled_from(["write", "read"]), st.integers(0, 14), st.integers(1, 3)), min_size=10, max_size=40),
    write=st.sampled_from(["write_back", "write_through"]),
)
def test_cascade_keeps_every_block_reachable_until_disk_cap(tmp_path_factory, ops, write) -> None:  # noqa: ANN001
    root = tmp_path_factory.mktemp("cascade")
    s = _store(root, write, disk_cap=256 * 1024)
    truth: dict[bytes, torch.Tensor] = {}  # key -> bytes of every block ever committed
    dropped_by_disk: set[bytes] = set()
    try:
        for kind, doc, nblocks in ops:
            tokens = [doc * 1000 + i for i in range(nblocks * BS)]
            keys = s.keys(tokens)
            if kind == "write":
                m = s.lookup(tokens)
                lease = s.acquire(m)
                have = lease.resolve() // BS
                new = s.allocate(len(keys) - have)
                data = fill_keyed(s, new, keys[have:])  # a key's bytes never change, as in an engine
                s.commit(keys, lease.block_ids + new, tokens)
                for k, d in zip(keys[have:], data):
                    truth.setdefault(k, d)
                s.free(new)
                s.release(lease)
            else:
                m = s.lookup(tokens)
                lease = s.acquire(m)
                n = lease.resolve() // BS
                lease.wait()
                for k, b in zip(keys[:n], lease.block_ids):
                    assert torch.equal(s.pool.block(b), truth[k]), "served KV differs from what was written"
                s.release(lease)
            for ev in s.drain_events():
                if ev.tier == "disk" and ev.kind == "evicted":
                    dropped_by_disk.add(ev.key)
            s.check_integrity()
            # Reachability: every key written and never dropped by the disk cap is found, with its prefix.
            for k in truth:
                if k in dropped_by_disk:
                    continue
                entry = s.index.get(k)
                assert (entry is not None and entry.tier is not None) or s.h.disk.contains(k), "block lost"  # type: ignore[union-attr]
        disk_stats = s.h.disk.stats()  # type: ignore[union-attr]
        assert disk_stats.used_bytes <= 256 * 1024
    finally:
        s.close()
