"""What a daemon on each shipped config holds in memory while no engine uses it.

A daemon serving any layout (``make run``'s ``configs/default.yaml``, ``configs/sidecar.yaml``) maps each
layout's arena sparsely and opens it with its first client; until then it has not even imported torch
(``kvstore.tiers`` imports the tiers on first use), so an idle daemon beside the engines costs tens of MB,
not the 1.36 GB a prefaulted 1 GiB arena did. Numbers: docs/BENCHMARKS.md "daemon memory".
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from daemonlib import cleanup, rss, shipped_config, short_tmpdir, start_daemon
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.client.tier import DaemonTier
from kvstore.layout import KVLayout

IDLE_LIMIT = 200 << 20
"""Most resident bytes of an idle daemon on a shipped config (issue 42's bound)."""
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", model_id="small")


@pytest.mark.parametrize("name", ["default.yaml", "sidecar.yaml"])
def test_an_idle_daemon_on_a_shipped_config_holds_at_most_200_mb(name: str) -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(shipped_config(name, root))
        idle = rss(d.proc.pid)
        assert idle <= IDLE_LIMIT, f"an idle daemon on configs/{name} holds {idle >> 20} MiB"
        assert "torch" not in Path(f"/proc/{d.proc.pid}/maps").read_text()  # nothing opened: torch not loaded
        client = DaemonClient(SMALL, socket_path=d.socket_path, client_name="engine")
        client.connect(10)
        tier = DaemonTier(SMALL, client)
        assert all(tier.put([b"k" * 32], [torch.zeros(SMALL.bytes_per_block, dtype=torch.uint8)]))  # its first layout opens: torch loads
        client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)
