"""One engine-like process of the ``remote`` suite's fleet replay: its share of the Mooncake trace through a
real :class:`~kvstore.store.tiered.TieredStore` (small GPU pool and host tier, optionally the shared Redis tier).

Run as ``python -m benchmarks.remote_replay WORKER OF URL TRACE LIMIT TIERS`` (TIERS ``host`` or
``host,remote``); prints one JSON line ``{"blocks": …, "hit_blocks": {"gpu": …, …}}``. Worker ``i`` of
``n`` takes requests ``i, i+n, i+2n, …`` (a load balancer spreading conversations over engines). Each
512-token trace block is one store block whose tokens are its hash id: ids are prefix-unique, so the
chain keys agree across processes exactly when the prompts share a prefix.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvstore.config.remote import RemoteConfig
from kvstore.config.schema import PolicyConfig
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout
from kvstore.store.tiered import TieredStore
from kvstore.tiers.host.tier import HostTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float16", model_id="mooncake-replay")
"""Small blocks (1 KiB): the replay measures reuse, not bandwidth."""
GPU_BLOCKS = 256
HOST_BLOCKS = 1024
GROUP_BLOCKS = 4


def replay(worker: int, of: int, url: str, trace: Path, limit: int, tiers: list[str]) -> dict[str, object]:
    """Replay this worker's requests; returns block counts by the tier they were found in."""
    from kvstore.bench.mooncake import load_mooncake
    from kvstore.tiers.redis.tier import RedisTier

    requests = load_mooncake(trace, limit).requests[worker::of]
    pool = GPUBlockPool(LAYOUT, GPU_BLOCKS, device="cpu")
    host = HostTier(LAYOUT, HOST_BLOCKS * LAYOUT.bytes_per_block, auto_evict=False, pin_memory="never")
    remote = None
    if "remote" in tiers:
        # the hit rate is the figure here: a probe is never cut short by a loaded machine
        remote = RedisTier(LAYOUT, RemoteConfig(url=url, group_blocks=GROUP_BLOCKS, key_prefix="replay:",
                                                listen_evictions=False, probe_timeout_s=5.0))
    store = TieredStore(LAYOUT, pool, host, None, PolicyConfig(write="write_back"), remote=remote)
    hits = {"gpu": 0, "host": 0, "disk": 0, "remote": 0}
    blocks = 0
    for req in requests:
        ids = [int(x) for x in req.blocks][: GPU_BLOCKS // 2]
        if not ids:
            continue
        tokens = [t for i in ids for t in [i] * LAYOUT.block_size]
        blocks += len(ids)
        lease = store.acquire(store.lookup(tokens))
        lease.resolve()
        lease.wait()
        for tier, n in lease.tokens_by_tier().items():
            hits[tier] += n // LAYOUT.block_size
        have = lease.block_ids
        new = store.allocate(len(ids) - len(have))
        store.commit(store.keys(tokens), list(have) + new, tokens)
        store.free(new)
        store.release(lease)
    store.flush()
    stats = store.stats()
    store.close()
    return {"worker": worker, "requests": len(requests), "blocks": blocks, "hit_blocks": hits,
            "remote_errors": stats.get("remote", {}).get("errors", 0)}


if __name__ == "__main__":
    w, n, url, trace, limit, tiers = sys.argv[1:7]
    print(json.dumps(replay(int(w), int(n), url, Path(trace), int(limit), tiers.split(","))))
