"""What ``disk.sync`` (and ``slab.sync``) promises through the daemon, tested with kill -9 of
the daemon, for the LMDB and the slab disk tier.

``always``: every put the daemon acknowledged survives, with no FLUSH. ``interval``: what a FLUSH
acknowledged survives (puts acknowledged after the last FLUSH may be lost)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from daemonlib import assert_acknowledged_survive, block_for, cleanup, keys_for, short_tmpdir, start_daemon, write_config
from kvstore.errors import TierError

WRITERS = 3
ROUNDS = 40
"""Acknowledged rounds (of 8 blocks) before the daemon is killed."""


@pytest.mark.parametrize("disk", ["lmdb", "slab"])
@pytest.mark.parametrize("sync", ["always", "interval"])
def test_kill9_keeps_what_the_sync_mode_promises(sync: str, disk: str) -> None:
    root = short_tmpdir()
    daemon = None
    try:
        # sync_interval_ms is long, so under "interval" nothing but FLUSH makes a put durable.
        if disk == "lmdb":
            config = write_config(root, disk={"sync": sync, "sync_interval_ms": 60_000})
        else:
            config = write_config(root, tiers=["host", "slab"],
                                  slab={"path": str(root / "slab"), "max_size": "16MiB", "sync": sync, "sync_interval_ms": 60_000})
        daemon = start_daemon(config)
        promised: list[list[bytes]] = [[] for _ in range(WRITERS)]
        attempted: list[list[bytes]] = [[] for _ in range(WRITERS)]
        rounds = [0]

        def writer(w: int) -> None:
            tier = daemon.tier(client_name=f"writer {w}", backoff_initial_s=5.0)
            for i in range(100_000):
                keys = keys_for(8, seed=1_000_000 * (w + 1) + i)
                attempted[w].extend(keys)
                stored = tier.put(keys, [block_for(k) for k in keys])  # True: acknowledged (it degrades, never raises)
                if sync == "always":
                    promised[w].extend(k for k, s in zip(keys, stored) if s)
                else:
                    try:
                        tier.flush()
                    except TierError:
                        return  # the daemon died: nothing after the last FLUSH is promised
                    promised[w].extend(k for k, s in zip(keys, stored) if s)
                if tier.client.hello is None:
                    return  # the daemon is gone
                rounds[0] += 1

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while rounds[0] < ROUNDS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
        for t in threads:
            t.join(30)
        acked = [k for ks in promised for k in ks]
        assert len(acked) >= ROUNDS * 8 // 2

        daemon = start_daemon(config)
        tier = daemon.tier(client_name="checker")
        assert_acknowledged_survive(tier, attempted, acked, f"sync={sync}")
        tier.close()
        assert daemon.stop() == 0
    finally:
        cleanup(daemon, root)
