"""Two daemons never share a data directory or a shared-memory segment (issue 10 item 11); damaged disk
files stop the daemon with a clean error, never a signal (item 12)."""

from __future__ import annotations

import subprocess
import sys

import torch

from daemonlib import REPO, block_for, cleanup, empty_blocks, keys_for, shm_exists, short_tmpdir, start_daemon, write_config


def serve_expecting_refusal(config: object, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``kvstore serve`` on a config that must not start; returns the finished process."""
    return subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(config)],
                          capture_output=True, text=True, cwd=REPO, timeout=timeout)


def test_second_daemon_on_the_same_directory_or_segment_is_refused_and_the_first_keeps_serving() -> None:
    root = short_tmpdir()
    first = None
    try:
        shm = f"kvstore-t11-{root.name}"
        first = start_daemon(write_config(root, host={"shm_name": shm}))
        tier = first.tier(client_name="first")
        keys = keys_for(8, seed=11)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 8
        tier.flush()

        (root / "b").mkdir()
        same_dir = serve_expecting_refusal(write_config(
            root / "b", disk={"path": str(root / "lmdb")}, host={"shm_name": shm + "-b"}))
        assert same_dir.returncode == 1 and same_dir.stdout == ""
        assert f"disk.path {root / 'lmdb'} is in use by another kvstore process, pid {first.proc.pid} (" in same_dir.stderr
        assert not shm_exists(shm + "-b")  # the refused daemon removed the segment it had created

        (root / "c").mkdir()
        same_shm = serve_expecting_refusal(write_config(root / "c", host={"shm_name": shm}))
        assert same_shm.returncode == 1 and same_shm.stdout == ""
        assert f"shared memory segment '{shm}' belongs to a running daemon, pid {first.proc.pid} (" in same_shm.stderr
        assert shm_exists(shm)

        dests = empty_blocks(8)  # the first daemon's clients still read exactly their blocks
        assert tier.get(keys, dests) == [True] * 8
        assert all(torch.equal(d, block_for(k)) for d, k in zip(dests, keys))
        tier.close()
        assert first.stop() == 0
    finally:
        cleanup(first, root)
