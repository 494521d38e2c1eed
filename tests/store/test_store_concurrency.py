"""Many threads sharing one store never see wrong KV: the silent-corruption check."""

from __future__ import annotations

import random
import threading

import torch

from kvstore.errors import OutOfBlocks
from storelib import LAYOUT, MemoryTier, make_store

BS = LAYOUT.block_size


def _content(key: bytes) -> torch.Tensor:
    """The KV every writer produces for ``key`` (deterministic, so concurrent writers agree)."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randn(LAYOUT.block_shape, generator=g).to(LAYOUT.torch_dtype)


def test_concurrent_requests_never_see_wrong_kv() -> None:
    disk = MemoryTier(LAYOUT, capacity_blocks=40, delay_s=0.0005)
    s = make_store(gpu_blocks=24, host_blocks=10, disk=disk, write="write_through")
    docs = [[d * 1000 + i for i in range(6 * BS)] for d in range(8)]
    errors: list[str] = []
    served = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(40):
            tokens = docs[rng.randrange(len(docs))][: BS * rng.randint(1, 6)]
            keys = s.keys(tokens)
            lease = s.acquire(s.lookup(tokens))
            n = lease.resolve() // BS
            lease.wait()
            for k, b in zip(keys[:n], lease.block_ids):
                if not torch.equal(s.pool.block(b), _content(k)):
                    errors.append(f"wrong KV for block {k.hex()[:12]}")
            served[0] += n
            try:
                new = s.allocate(len(keys) - n)
            except OutOfBlocks:
                s.release(lease)
                continue
            for k, b in zip(keys[n:], new):
                s.pool.block(b).copy_(_content(k))
            s.commit(keys, lease.block_ids + new, tokens)
            s.free(new)
            s.release(lease)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors[:5]
    assert served[0] > 0
    st = s.stats()
    assert st["host"]["loaded_blocks"] > 0 and st["disk"]["loaded_blocks"] > 0, "loads from both tiers were exercised"
    s.flush()
    s.check_integrity()
    assert s.pool.num_used == sum(1 for n in s.index.nodes() for e in n.entries if e.gpu_block is not None)
