"""Replay a trace through a real :class:`~kvstore.store.tiered.TieredStore`: the GPU pool (on the CPU), the host tier
and the slab disk tier, under a named placement policy, with an engine's calls per request.

The hit-rate suite's model (:class:`~kvstore.bench.cache_sim.TieredCacheSim`) replays a whole trace in
seconds; the store takes about a millisecond per block. This replays a sample through the store itself, so
the suite can report how far the model is from what the store keeps (``store_check`` figures).

Per request, as an engine drives the store: ``lookup`` (the matched prefix and the tier of each block),
``acquire`` and wait (loads into the GPU), ``allocate`` the rest, ``commit`` every full block, ``free`` and
``release``. A block is one token (block ids are the trace's chain ids), ``write: write_back``; the disk tier
is a slab tier (capacity exact in slots) in a temporary directory.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.bench.cache_sim import HitCounts
from kvstore.bench.workloads import Request
from kvstore.config.schema import PolicyConfig
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout
from kvstore.policy.named import PlacementPolicy
from kvstore.store.tiered import TieredStore
from kvstore.tiers.host.tier import HostTier
from kvstore.tiers.codec import HEADER_SIZE
from kvstore.tiers.slab.tier import SlabTier
from kvstore.tiers.slab.data_file import slot_bytes

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=1, dtype="float16", model_id="store-replay")


@contextmanager
def replay_store(policy: PlacementPolicy, gpu_blocks: int, host_blocks: int, disk_blocks: int) -> Iterator[TieredStore]:
    """A store of exactly these capacities in blocks under ``policy`` (``write_back``), removed afterwards."""
    root = tempfile.mkdtemp(prefix="kvreplay")
    store = None
    try:
        orders = policy.orders(both_tiers=host_blocks > 0 and disk_blocks > 0)
        pool = GPUBlockPool(LAYOUT, gpu_blocks, device="cpu")
        host = (HostTier(LAYOUT, host_blocks * LAYOUT.bytes_per_block, auto_evict=False, order=orders.host,
                         pin_memory="never", prefault=False) if host_blocks else None)
        disk = None
        if disk_blocks:
            slot = slot_bytes(HEADER_SIZE + LAYOUT.bytes_per_block)  # as SlabTier sizes its slots
            disk = SlabTier(LAYOUT, f"{root}/slab", disk_blocks * slot, direct_io=False, order=orders.disk)
        store = TieredStore(LAYOUT, pool, host, disk, PolicyConfig(write="write_back"), placement=policy)
        yield store
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(root, ignore_errors=True)


def serve(store: TieredStore, req: Request) -> HitCounts:
    """One request as an engine makes it; returns the blocks of its prefix found per tier."""
    ids = req.blocks.tolist()
    match = store.lookup(ids)
    found = HitCounts(match.tiers.count("gpu"), match.tiers.count("host"), match.tiers.count("disk"))
    lease = store.acquire(match)
    lease.resolve()
    lease.wait()
    have = list(lease.block_ids)
    new = store.allocate(len(ids) - len(have))
    store.commit(store.keys(ids), have + new, ids)
    store.free(new)
    store.release(lease)
    store.spiller.wait()  # write-downs of this request done before the next: the store at rest, as the model is
    return found
