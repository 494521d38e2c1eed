"""A short end-to-end smoke run of the store on a config (what ``make run`` shows today)."""

from __future__ import annotations

import logging

import torch

from kvstore.config import KVStoreConfig
from kvstore.gpu_pool import GPUBlockPool
from kvstore.hashing import block_keys
from kvstore.radix import RadixIndex

log = logging.getLogger("kvstore.smoke")


def run_smoke(cfg: KVStoreConfig) -> int:
    """Cache one prompt's blocks, then find the shared prefix of a second prompt; prints what happened."""
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    layout = cfg.model.layout()
    device = None if cfg.gpu.device == "auto" else cfg.gpu.device
    pool = GPUBlockPool(layout, min(cfg.gpu.num_blocks, 64), device=device)
    index = RadixIndex(layout)
    bs = layout.block_size
    system = list(range(1000, 1000 + 4 * bs))
    first = system + list(range(5000, 5000 + 2 * bs))
    second = system + list(range(7000, 7000 + 3 * bs))

    keys = block_keys(first, layout)
    blocks = pool.allocate(len(keys))
    for b in blocks:
        pool.block(b).copy_(torch.randn(layout.block_shape).to(layout.torch_dtype))
    index.insert(keys, gpu_blocks=blocks)
    log.info("layout %s: %d bytes per block, fingerprint %s", layout, layout.bytes_per_block, layout.fingerprint.hex())
    log.info("cached %d blocks of prompt 1 in GPU pool on %s (%d/%d used)", len(keys), pool.device, pool.num_used, pool.num_blocks)

    match = index.match(second)
    log.info(
        "prompt 2 (%d tokens): %d of %d full blocks cached (gpu %d, host %d, disk %d); %d tokens to compute",
        len(second), match.num_blocks, len(second) // bs, match.gpu_blocks, match.host_blocks, match.disk_blocks,
        len(second) - match.num_blocks * bs,
    )
    index.check_integrity()
    pool.check_integrity()
    print(f"smoke run OK: prompt 2 reused {match.num_blocks * bs} of {len(second)} tokens from the cache")
    return 0
