"""Two daemons never share a data directory; damaged disk files stop the daemon with a clean error, never a
signal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from daemonlib import REPO, block_for, cleanup, empty_blocks, keys_for, short_tmpdir, start_daemon, write_config

sys.path.insert(0, str(Path(__file__).parents[1] / "tiers"))
from tiers_testlib import damage_leaf_of  # noqa: E402


def serve_expecting_refusal(config: object, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``kvstore serve`` on a config that must not start; returns the finished process."""
    return subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(config)],
                          capture_output=True, text=True, cwd=REPO, timeout=timeout)


def test_second_daemon_on_the_same_directory_is_refused_and_the_first_keeps_serving() -> None:
    """Only the data directory can be contended: each daemon's arena is its own unnamed memfd, which no other
    daemon can open by name, let alone claim (:mod:`kvstore.tiers.host.arena`)."""
    root = short_tmpdir()
    first = None
    try:
        first = start_daemon(write_config(root))
        tier = first.tier(client_name="first")
        keys = keys_for(8, seed=11)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 8
        tier.flush()

        (root / "b").mkdir()
        same_dir = serve_expecting_refusal(write_config(root / "b", disk={"path": str(root / "lmdb")}))
        assert same_dir.returncode == 1 and same_dir.stdout == ""
        assert f"disk.path {root / 'lmdb'} is in use by another kvstore process, pid {first.proc.pid} (" in same_dir.stderr

        dests = empty_blocks(8)  # the first daemon's clients still read exactly their blocks
        assert tier.get(keys, dests) == [True] * 8
        assert all(torch.equal(d, block_for(k)) for d, k in zip(dests, keys))
        tier.close()
        assert first.stop() == 0
    finally:
        cleanup(first, root)


def test_damaged_disk_tier_never_kills_the_daemon_or_a_connection() -> None:
    root = short_tmpdir()
    daemon = None
    try:
        config = write_config(root)
        daemon = start_daemon(config)
        tier = daemon.tier(client_name="writer")
        keys = keys_for(120, seed=12)
        for i in range(0, 120, 40):
            assert tier.put(keys[i : i + 40], [block_for(k) for k in keys[i : i + 40]]) == [True] * 40
        tier.flush()
        tier.close()
        assert daemon.stop() == 0

        # A damaged page: the blocks on it are misses, the rest are served, the connection stays up.
        assert damage_leaf_of(str(root / "lmdb" / "data.mdb"), min(keys)) >= 1
        daemon = start_daemon(config)
        tier = daemon.tier(client_name="reader")
        dests = empty_blocks(120)
        found = tier.get(keys, dests)
        assert 0 < found.count(False) < 120 and not found[keys.index(min(keys))]
        assert all(torch.equal(d, block_for(k)) for d, k, ok in zip(dests, keys, found) if ok)
        assert tier.get(keys, empty_blocks(120)) == found  # same connection, same answer
        tier.close()
        assert daemon.stop() == 0

        # A truncated data.mdb: a clean refusal naming the file and the way out, not SIGBUS.
        data = root / "lmdb" / "data.mdb"
        os.truncate(data, data.stat().st_size // 2)
        refused = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(config)],
                                 capture_output=True, text=True, cwd=REPO, timeout=60)
        assert refused.returncode == 1, refused.stderr[-2000:]
        assert f"error: cannot start the daemon: LMDB environment {data} is truncated" in refused.stderr
        assert "kvstore repair --config" in refused.stderr
        repaired = subprocess.run([sys.executable, "-m", "kvstore", "repair", "--config", str(config)],
                                  capture_output=True, text=True, cwd=REPO, timeout=60)
        assert repaired.returncode == 0 and "kept for inspection" in repaired.stdout, repaired.stderr
        daemon = start_daemon(config)  # starts afresh
        assert daemon.stop() == 0
    finally:
        cleanup(daemon, root)
