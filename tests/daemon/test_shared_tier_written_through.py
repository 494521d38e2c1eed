"""Under the default ``policy.write: write_back`` a store whose tier below the GPU is a daemon still writes
each committed block to it at once: the daemon is shared, and a block reaching it only when it leaves one
engine's GPU is one no other engine finds while the first still runs."""

from __future__ import annotations

import torch
from daemonlib import LAYOUT, cleanup, empty_blocks, short_tmpdir, start_daemon, write_config

from kvstore.config.schema import PolicyConfig
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.store.tiered import TieredStore


def test_a_committed_block_is_in_the_daemon_before_any_flush_or_eviction() -> None:
    assert PolicyConfig().write == "write_back"  # the default this guards
    root = short_tmpdir()
    daemon = None
    try:
        daemon = start_daemon(write_config(root))
        writer_tier, reader = daemon.tier(client_name="engine-a"), daemon.tier(client_name="engine-b")
        store = TieredStore(LAYOUT, GPUBlockPool(LAYOUT, 16, device="cpu"), host=None, disk=writer_tier,
                            policy=PolicyConfig())
        tokens = list(range(3 * LAYOUT.block_size))
        keys = store.keys(tokens)
        blocks = store.allocate(3)
        data = [torch.randn(LAYOUT.block_shape, generator=torch.Generator().manual_seed(i)).to(LAYOUT.torch_dtype)
                for i in range(3)]
        for b, d in zip(blocks, data):
            store.pool.block(b).copy_(d)
        store.commit(keys, blocks, tokens)
        store.spiller.wait()  # the write-down runs on the spiller's thread; no flush, no GPU eviction
        assert store.index.get(keys[0]) is not None and store.index.get(keys[0]).gpu_block is not None  # still on GPU
        dests = empty_blocks(3)
        assert reader.get(keys, dests) == [True] * 3  # another engine finds all three now
        assert all(torch.equal(d, x.view(torch.uint8).flatten()) for d, x in zip(dests, data))
        store.close()
        reader.close()
    finally:
        cleanup(daemon, root)
