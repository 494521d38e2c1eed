"""The eviction cascade on real tiers: every block stays reachable until the disk cap drops it, under every
named placement policy (``policy.placement``) and every variant of one (any host and disk eviction order, use
counts carried across tiers or not, the counts of dropped blocks remembered, inclusive or exclusive tiers): a
policy changes which blocks the tiers keep, never whether what is served is what was written or whether a
block is reported where it is not."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.config.schema import PolicyConfig
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.store.tiered import TieredStore
from kvstore.tiers.lmdb.tier import DiskTier
from kvstore.policy.named import POLICIES, PlacementPolicy
from kvstore.policy.order import ORDERS, make_order
from kvstore.tiers.host.tier import HostTier
from storelib import LAYOUT, fill_keyed

BS = LAYOUT.block_size


def _store(root: Path, write: str, disk_cap: int, eviction: str = "lru", host_eviction: str = "lru",
           carry_uses: bool = False, exclusive: bool = False, named: str | None = None) -> TieredStore:
    """A store on real tiers: under the named policy ``named`` (its orders, its ``policy.placement``), or else
    under a variant of a policy (``placement=``) with these orders and switches."""
    pool = GPUBlockPool(LAYOUT, 6, device="cpu")
    if named is not None:
        orders = POLICIES[named].orders()
        host = HostTier(LAYOUT, 5 * LAYOUT.bytes_per_block, auto_evict=False, order=orders.host)
        disk = DiskTier(LAYOUT, root, disk_cap, sync="interval", order=orders.disk)
        return TieredStore(LAYOUT, pool, host, disk, PolicyConfig(write=write, placement=named))  # type: ignore[arg-type]
    host = HostTier(LAYOUT, 5 * LAYOUT.bytes_per_block, auto_evict=False, order=make_order(host_eviction))
    disk = DiskTier(LAYOUT, root, disk_cap, sync="interval", order=make_order(eviction))
    variant = PlacementPolicy("variant", "lru", carry_uses=carry_uses, exclusive_when_write_back=exclusive,
                              use_memory=2.0 if carry_uses else 0.0)
    return TieredStore(LAYOUT, pool, host, disk, PolicyConfig(write="write_back" if exclusive else write),
                       placement=variant)


OPS = st.lists(st.tuples(st.sampled_from(["write", "read"]), st.integers(0, 14), st.integers(1, 3)),
               min_size=10, max_size=40)
SMALL_DISK = 20 * 4096
"""A disk cap whose budget (less the tier's reserve) holds about 8 of these blocks: the disk really evicts."""


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, write=st.sampled_from(["write_back", "write_through"]), eviction=st.sampled_from(sorted(ORDERS)),
       host_eviction=st.sampled_from(sorted(ORDERS)), carry=st.booleans(), exclusive=st.booleans())
def test_cascade_keeps_every_block_reachable_until_disk_cap(tmp_path_factory, ops, write, eviction,  # noqa: ANN001
                                                             host_eviction, carry, exclusive) -> None:  # noqa: ANN001
    _replay(tmp_path_factory.mktemp("cascade"), ops, write, eviction, disk_cap=256 * 1024,
            host_eviction=host_eviction, carry_uses=carry, exclusive=exclusive)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, write=st.sampled_from(["write_back", "write_through"]), eviction=st.sampled_from(sorted(ORDERS)),
       host_eviction=st.sampled_from(sorted(ORDERS)), carry=st.booleans(), exclusive=st.booleans())
def test_every_eviction_order_serves_only_loadable_blocks_under_a_small_disk(tmp_path_factory, ops, write,  # noqa: ANN001
                                                                             eviction, host_eviction, carry,  # noqa: ANN001
                                                                             exclusive) -> None:  # noqa: ANN001
    _replay(tmp_path_factory.mktemp("small"), ops, write, eviction, disk_cap=SMALL_DISK,
            host_eviction=host_eviction, carry_uses=carry, exclusive=exclusive)


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, write=st.sampled_from(["write_back", "write_through"]), named=st.sampled_from(sorted(POLICIES)),
       small=st.booleans())
def test_every_named_policy_keeps_every_block_reachable_and_serves_only_what_was_written(
        tmp_path_factory, ops, write, named, small) -> None:  # noqa: ANN001
    _replay(tmp_path_factory.mktemp("named"), ops, write, "lru", disk_cap=SMALL_DISK if small else 256 * 1024,
            named=named)


def _replay(root: Path, ops: list[tuple[str, int, int]], write: str, eviction: str, disk_cap: int, *,
            host_eviction: str = "lru", carry_uses: bool = False, exclusive: bool = False,
            named: str | None = None) -> None:
    """Writes and reads through a store on real tiers; checks served bytes, integrity and reachability each step.

    A read holds its lease (GPU references) while its bytes are compared, so a block a request holds that
    was evicted or reused would show as wrong bytes.
    """
    s = _store(root, write, disk_cap, eviction, host_eviction, carry_uses, exclusive, named)
    truth: dict[bytes, torch.Tensor] = {}  # key -> bytes of every block ever committed
    prefix: dict[bytes, list[bytes]] = {}  # key -> the keys before it in its prompt
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
                for i, (k, d) in enumerate(zip(keys[have:], data), have):
                    truth.setdefault(k, d)
                    prefix.setdefault(k, keys[:i])
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
            s.flush()  # integrity holds at rest: a disk victim leaves the index just after its write transaction
            for ev in s.drain_events():
                if ev.tier == "disk" and ev.kind == "evicted":
                    dropped_by_disk.add(ev.key)
            s.check_integrity()
            # Reachability: every key written is found unless the disk cap dropped it or a block of its
            # prefix (a block after a lost one is useless and leaves the index with it).
            for k in truth:
                if k in dropped_by_disk or dropped_by_disk.intersection(prefix[k]):
                    continue
                entry = s.index.get(k)
                assert (entry is not None and entry.tier is not None) or s.h.disk.contains(k), "block lost"  # type: ignore[union-attr]
        disk_stats = s.h.disk.stats()  # type: ignore[union-attr]
        assert disk_stats.used_bytes <= disk_cap
    finally:
        s.close()
