"""The background sync: every interval, at once once ``sync_bytes`` are pending (LMDB tier), survives errors."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from tiers_testlib import BIG, make_blocks, make_keys

from kvstore.errors import TierError
from kvstore.tiers import DiskTier
from kvstore.tiers.lmdb.env import LmdbEnv
from kvstore.tiers.sync_loop import SyncLoop


def _wait_for(pred, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_kick_runs_the_work_without_waiting_out_the_interval_and_stop_joins() -> None:
    runs: list[float] = []
    loop = SyncLoop(lambda: runs.append(time.monotonic()), 3600.0, "test-sync")
    time.sleep(0.05)
    assert runs == []  # an hour's interval: nothing yet
    loop.kick()
    assert _wait_for(lambda: len(runs) == 1)
    loop.stop()
    loop.stop()  # idempotent
    assert len(runs) == 1 and not any(t.name == "test-sync" for t in threading.enumerate())


def test_a_failing_work_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def work() -> None:
        calls.append(1)
        raise TierError("disk gone")

    loop = SyncLoop(work, 0.01, "test-sync-err", "/data/x")
    assert _wait_for(lambda: len(calls) >= 3)
    loop.stop()
    assert "background sync of /data/x failed: disk gone" in caplog.text


def test_lmdb_syncs_as_soon_as_sync_bytes_are_pending_not_at_the_interval(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    syncs: list[float] = []
    real = LmdbEnv.sync
    monkeypatch.setattr(LmdbEnv, "sync", lambda self: (syncs.append(time.monotonic()), real(self))[1])
    tier = DiskTier(BIG, tmp_path, 16 << 20, sync="interval", sync_interval_ms=3_600_000,
                    sync_bytes=3 * BIG.bytes_per_block)
    try:
        keys, blocks = make_keys(BIG, 4), make_blocks(BIG, 4)
        tier.put(keys[:2], blocks[:2])
        time.sleep(0.1)
        assert syncs == []  # under the byte trigger, and the interval is an hour
        tier.put(keys[2:], blocks[2:])
        assert _wait_for(lambda: len(syncs) == 1)  # over it: the sync thread was woken
    finally:
        tier.close()
