"""A lookup never waits on a slow Redis beyond ``remote.probe_timeout_s``: with the server paused
(``CLIENT PAUSE``) the remote part of the lookup is a miss, counted, and the tier answers again after."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from remotelib import remote_tier, wait_for

sys.path.insert(0, str(Path(__file__).parent.parent / "store"))
from storelib import LAYOUT, prefill  # noqa: E402

from benchmarks.redis_servers import start_server  # noqa: E402
from kvstore.store.gpu_pool import GPUBlockPool  # noqa: E402
from kvstore.store.tiered import TieredStore  # noqa: E402
from kvstore.tiers.host.tier import HostTier  # noqa: E402


def _store(url: str, write: str) -> TieredStore:
    pool = GPUBlockPool(LAYOUT, 32, device="cpu")
    host = HostTier(LAYOUT, 32 * LAYOUT.bytes_per_block, auto_evict=False)
    # a reply timeout far above the probe bound: only the bound can make the lookup return early
    remote = remote_tier(LAYOUT, url, group_blocks=4, key_prefix="probe:", listen_evictions=False,
                         timeout_s=5.0, probe_timeout_s=0.15, reconnect_min_s=0.05, reconnect_max_s=0.05)
    return TieredStore(LAYOUT, pool, host, None, remote=remote, remote_write=write)  # type: ignore[arg-type]


def test_a_paused_server_makes_the_probe_a_bounded_counted_miss(tmp_path: Path) -> None:
    server = start_server(tmp_path / "paused")
    try:
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, 1000, (8 * LAYOUT.block_size + 1,), generator=g).tolist()
        writer = _store(server.url, "write_through")
        prefill(writer, tokens, seed=7)
        writer.flush()
        writer.close()
        assert server.cli("DBSIZE").strip() == "2"  # both groups are stored (checked without a bounded probe)
        reader = _store(server.url, "read_only")
        server.cli("CLIENT", "PAUSE", "3000", "ALL")
        t0 = time.monotonic()
        m = reader.lookup(tokens)
        took = time.monotonic() - t0
        assert m.num_blocks == 0  # the remote part is a miss, not an error
        assert took < 1.0, f"lookup took {took:.2f}s with probe_timeout_s 0.15 (the reply timeout is 5 s)"
        st = reader.stats()["remote"]
        assert st["probe_timeouts"] == 1 and st["errors"] >= 1
        server.cli("CLIENT", "UNPAUSE")
        wait_for(lambda: reader.lookup(tokens).num_blocks == 8, 10, "the remote prefix to be found again")
        reader.close()
    finally:
        server.stop()
