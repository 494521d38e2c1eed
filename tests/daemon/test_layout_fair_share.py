"""Layouts sharing one daemon's budgets get room from each other even while the other is busy.

Under ``daemon.layouts: any`` the host arenas and LMDB environments of every layout share ``host.capacity``
and ``disk.max_size``. Once the disk is full (a cache's normal state) and one layout is flooded by writers
that keep its locks busy, another layout's puts must still be stored and its acknowledged blocks must still
reach the disk: room is reclaimed from the busy layout by waiting a bounded time for its locks
(:data:`kvstore.tiers.shared_capacity.RECLAIM_WAIT_S`), so FLUSH succeeds. The flooders are separate
processes, as engines are.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from daemonlib import cleanup, keys_for, short_tmpdir, start_daemon, write_config
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.server.layout_dirs import layout_label
from kvstore.daemon.client.tier import DaemonTier
from kvstore.layout import KVLayout

FLOODED = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32", model_id="flooded")
QUIET = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32", model_id="quiet")
"""Two layouts of 4 KiB blocks (different models: each has its own arena and LMDB environment)."""
HOST = 4 * 1024 * 1024
"""1024 blocks of either layout, shared: more than the flood keeps pinned (its reservations and write-behind
backlog, which no other layout may take), so a refused put would be the reclaim giving up."""
DISK = "2MiB"
"""Room for a few hundred blocks of either layout, shared: the flood fills it within a second."""
FLOODERS = 2

FLOOD = textwrap.dedent("""
    import os, sys, torch
    from kvstore.daemon.client.connection import DaemonClient
    from kvstore.daemon.client.tier import DaemonTier
    from kvstore.layout import KVLayout
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32", model_id="flooded")
    sock, seed, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    client = DaemonClient(layout, socket_path=sock, client_name="flood " + seed)
    client.connect(10)
    tier = DaemonTier(layout, client)
    block = torch.full((layout.bytes_per_block,), 7, dtype=torch.uint8)
    print("flooding", flush=True)
    i = 0
    while not os.path.exists(stop):
        keys = [f"{seed}:{i}:{j}".encode().ljust(32, b".") for j in range(16)]
        tier.put(keys, [block] * 16)
        i += 1
    client.close()
""")


def _config(root: Path) -> Path:
    return write_config(root, daemon={"layouts": "any", "hold_timeout_s": 5.0},
                        host={"capacity": HOST, "prefault": False}, disk={"max_size": DISK, "sync": "interval"})


def _tier(socket_path: str, layout: KVLayout, name: str) -> DaemonTier:
    client = DaemonClient(layout, socket_path=socket_path, client_name=name)
    client.connect(10)
    return DaemonTier(layout, client)


def test_a_flooded_layout_never_denies_another_its_puts_or_its_flush() -> None:
    root = short_tmpdir()
    d = None
    flooders: list[subprocess.Popen[str]] = []
    stop = root / "stop"
    try:
        d = start_daemon(_config(root))
        quiet = _tier(d.socket_path, QUIET, "quiet engine")
        # the quiet layout opens first and the flooders fill both budgets with their blocks
        for seed in range(FLOODERS):
            flooders.append(subprocess.Popen([sys.executable, "-c", FLOOD, d.socket_path, str(seed), str(stop)],
                                             stdout=subprocess.PIPE, text=True))
        for f in flooders:
            assert f.stdout is not None and f.stdout.readline().strip() == "flooding"
        limit = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the disk full of the flooded layout's blocks: a cache's normal state
            stats = quiet.client.stats()
            limit = stats["disk"]["capacity_bytes"]
            flooded = stats["layouts"].get(layout_label(FLOODED), {}).get("disk") or {}
            if flooded.get("used_bytes", 0) > limit * 0.8 and flooded.get("evictions", 0) > 0:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the flooders never filled the disk")

        stored = attempted = 0
        for i in range(30):  # while the flood goes on, the quiet layout stores some blocks now and then
            keys = keys_for(8, seed=1000 + i)
            block = torch.full((QUIET.bytes_per_block,), i % 251, dtype=torch.uint8)
            stored += sum(quiet.put(keys, [block] * len(keys)))
            attempted += len(keys)
            time.sleep(0.02)
        assert stored == attempted, f"the quiet layout stored {stored} of {attempted} blocks beside the flood"
        quiet.flush()  # raises NotDurable when acknowledged blocks failed to reach the disk
        stats = quiet.client.stats()
        mine = stats["layouts"][layout_label(QUIET)]
        assert mine["not_durable"] == 0 and mine["write_failures"] == 0, mine
        assert stats["disk"]["used_bytes"] <= limit * 1.05, "the layouts together stay within disk.max_size"

        stop.touch()
        for f in flooders:
            assert f.wait(30) == 0
        quiet.client.close()
        rc = d.stop()
        # The shutdown flush finds none of the quiet layout's blocks lost. (The flooded layout's own map, this
        # small, may refuse a block of its flood when LMDB cannot reuse its free pages in time: exit 3 then,
        # naming that layout alone.)
        assert rc in (0, 3) and f"shutdown flush of {layout_label(QUIET)}" not in d.log.read_text()
    finally:
        stop.touch()
        for f in flooders:
            if f.poll() is None:
                f.kill()
                f.wait()
        cleanup(d, root)
