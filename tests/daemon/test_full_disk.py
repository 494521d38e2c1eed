"""Through a real daemon: a full disk makes FLUSH fail with the count of acknowledged blocks that
did not reach disk, reads go on, /metrics counts it, the log says it once, SIGTERM exits non-zero, and the count
is exactly what a restart lost. Once with an injected ENOSPC, once (as root) on a real, small tmpfs."""

from __future__ import annotations

import os
import subprocess
import urllib.request
from pathlib import Path

import pytest

from daemonlib import Daemon, block_for, cleanup, empty_blocks, keys_for, short_tmpdir, start_daemon, write_config
from kvstore.cli.serve_cmd import EXIT_NOT_DURABLE
from kvstore.errors import NotDurable

DISK_FULL_WHEN_FLAG_EXISTS = """
import os, lmdb
from kvstore.tiers.lmdb.tier import DiskTier
_put = DiskTier.put
def put(self, keys, srcs):
    if os.path.exists({flag!r}):
        raise lmdb.Error("mdb_txn_commit: No space left on device")
    return _put(self, keys, srcs)
DiskTier.put = put
"""


def _put_all(daemon: Daemon, keys: list[bytes], batch: int = 16) -> int:
    tier = daemon.tier(client_name="writer")
    acked = 0
    for i in range(0, len(keys), batch):
        acked += sum(tier.put(keys[i : i + batch], [block_for(k) for k in keys[i : i + batch]]))
    tier.client.close()
    return acked


def _present(daemon: Daemon, keys: list[bytes]) -> set[bytes]:
    tier = daemon.tier(client_name="checker")
    dests = empty_blocks(len(keys))
    found = tier.get(keys, dests)
    for key, ok, dest in zip(keys, found, dests):
        assert not ok or bytes(dest.numpy()) == bytes(block_for(key).numpy()), f"wrong bytes for {key[:8].hex()}"
    tier.client.close()
    return {k for k, ok in zip(keys, found) if ok}


def _daemon_whose_disk_fills(root: Path) -> tuple[Daemon, Path, Path]:
    """A daemon (``sync: interval``) whose disk tier fails every put with ENOSPC while ``root/disk-full`` exists:
    ``(daemon, its config, that flag file)``."""
    flag = root / "disk-full"
    config = write_config(root, disk={"sync": "interval", "sync_interval_ms": 10_000})
    return start_daemon(config, before=DISK_FULL_WHEN_FLAG_EXISTS.format(flag=str(flag))), config, flag


def test_injected_enospc_flush_reports_the_lost_blocks_and_sigterm_exits_nonzero() -> None:
    root = short_tmpdir()
    daemon = None
    try:
        daemon, config, flag = _daemon_whose_disk_fills(root)
        good, lost = keys_for(8, seed=1), keys_for(40, seed=2)
        assert _put_all(daemon, good) == 8
        tier = daemon.tier(client_name="flusher")
        tier.flush()
        flag.touch()
        assert _put_all(daemon, lost) == 40  # acknowledged: sync is "interval", the write comes later
        with pytest.raises(NotDurable) as exc:
            tier.flush()
        assert (exc.value.blocks, exc.value.total) == (40, 40)
        assert "No space left on device" in exc.value.detail
        tier.flush()  # reported once to this connection; nothing new failed since
        assert _present(daemon, lost) == set(lost)  # the full disk does not stop reads: all 40 still in host
        stats = tier.client.stats()
        assert (stats["not_durable"], stats["write_failures"]) == (40, 40)
        assert daemon.metrics_url is not None
        metrics = urllib.request.urlopen(f"{daemon.metrics_url}/metrics", timeout=5).read().decode().splitlines()
        assert "kvstore_not_durable_total 40" in metrics and 'kvstore_errors_total{code="NOT_DURABLE"} 1' in metrics
        closer = daemon.tier(client_name="closer")  # an engine closing its store: the final flush reports the loss
        with pytest.raises(NotDurable, match="^40 acknowledged blocks are not durable"):
            closer.close()
        assert closer.client.hello is None  # and it disconnected anyway
        tier.client.close()
        assert daemon.stop() == EXIT_NOT_DURABLE
        log = daemon.log.read_text()
        assert log.count("write-behind to the lmdb tier failed") == 1, "a full disk must be logged once per interval"
        assert ("error: kvstore serve stopped, but acknowledged data is not durable: "
                "40 acknowledged blocks are not durable") in log
        flag.unlink()
        daemon = start_daemon(config)
        assert _present(daemon, good + lost) == set(good)  # exactly what FLUSH and the exit status reported
        assert daemon.stop() == 0
    finally:
        cleanup(daemon, root)


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_real_full_tmpfs() -> None:
    root = short_tmpdir()
    mnt = root / "fs"
    if not _mount_tmpfs(mnt, "160k"):
        cleanup(None, root)
        pytest.skip("needs root and tmpfs mounts; test_injected_enospc_... covers the same code path")
    daemon = None
    try:
        config = write_config(root, disk={"path": str(mnt / "lmdb"), "max_size": "8MiB", "sync": "interval"})
        daemon = start_daemon(config)
        keys = keys_for(640, seed=3)
        assert _put_all(daemon, keys) == 640
        tier = daemon.tier(client_name="flusher")
        with pytest.raises(NotDurable) as exc:
            tier.flush()
        assert 0 < exc.value.blocks < 640
        tier.client.close()
        assert daemon.stop() == EXIT_NOT_DURABLE
        daemon = start_daemon(config)
        assert len(_present(daemon, keys)) == 640 - exc.value.blocks
    finally:
        cleanup(daemon, root)
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_retried_flush_never_acknowledges_blocks_that_are_only_in_ram() -> None:
    """A failed FLUSH, the same blocks put again (still served from RAM, so "present"), FLUSH again.

    The second FLUSH must fail while the disk is still full (the re-put queued them again and their
    write failed again), and once space is back the re-put and FLUSH store them: a restart has them all.
    """
    root = short_tmpdir()
    daemon = None
    try:
        daemon, config, flag = _daemon_whose_disk_fills(root)
        keys = keys_for(16, seed=5)
        blocks = [block_for(k) for k in keys]
        tier = daemon.tier(client_name="retrier")
        flag.touch()
        assert tier.put(keys, blocks) == [True] * 16
        with pytest.raises(NotDurable) as first:
            tier.flush()
        assert first.value.blocks == 16
        assert tier.put(keys, blocks) == [True] * 16  # the retry: the blocks are still in the host tier
        with pytest.raises(NotDurable) as second:
            tier.flush()  # the disk is still full: not "durable" because RAM holds them
        assert second.value.blocks == 16
        flag.unlink()  # space again
        assert tier.put(keys, blocks) == [True] * 16
        tier.flush()  # now written
        tier.client.close()
        daemon.stop()
        daemon = start_daemon(config)
        assert _present(daemon, keys) == set(keys)  # what the last FLUSH acknowledged survived the restart
        assert daemon.stop() == 0
    finally:
        cleanup(daemon, root)
