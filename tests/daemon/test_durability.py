"""At the backend: FLUSH reports acknowledged blocks whose disk write failed, and
``disk.sync: always`` acknowledges a put only after its disk write (in-process, with an injected ENOSPC)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from daemonlib import block_for, keys_for
from faultydisk import faulty_backend
from kvstore.daemon.server.metrics import DaemonMetrics, render_prometheus
from kvstore.errors import NotDurable
from kvstore.lower.write_policy import WriteRule


def _put(backend, keys: list[bytes]) -> list[bool]:  # noqa: ANN001 - DaemonBackend
    return backend.put_inline(keys, [memoryview(block_for(k).numpy()) for k in keys])


@pytest.mark.parametrize("mode", ["raise", "refuse"])
def test_flush_reports_acknowledged_blocks_that_did_not_reach_disk(tmp_path: Path, mode: str) -> None:
    backend, disk = faulty_backend(tmp_path)
    try:
        good = keys_for(4, seed=1)
        assert _put(backend, good) == [True] * 4
        assert backend.flush() == 0  # nothing failed yet: the mark stays 0
        disk.mode = mode
        lost = keys_for(6, seed=2)
        assert _put(backend, lost) == [True] * 6  # acknowledged (sync: interval), written behind
        with pytest.raises(NotDurable, match=r"^6 acknowledged blocks are not durable: their write to the lmdb tier "
                           r"failed \(.+\)$") as exc:
            backend.flush()
        assert (exc.value.blocks, exc.value.total) == (6, 6)
        # Under a full disk reads go on: the blocks are still served, from the host tier, bit for bit.
        assert backend.read_inline(lost) == [block_for(k).numpy().tobytes() for k in lost]
        assert backend.flush(since=6) == 6  # a caller that was told about them sees no new failure
        with pytest.raises(NotDurable) as again:
            backend.flush(since=2)
        assert (again.value.blocks, again.value.total) == (4, 6)
        stats = backend.stats()
        assert (stats["write_failures"], stats["not_durable"], stats["counters"]["flush_failures"]) == (6, 6, 2)
        text = render_prometheus(DaemonMetrics(), stats, {"version": "test"})
        for line in ("kvstore_write_failures_total 6", "kvstore_not_durable_total 6", "kvstore_flush_failures_total 2"):
            assert line in text.splitlines()
        disk.mode = "ok"
        assert _put(backend, keys_for(3, seed=3)) == [True] * 3
        assert backend.flush(since=6) == 6  # the disk recovered: new puts are durable again
        assert all(disk.inner.contains(k) for k in good + keys_for(3, seed=3))
    finally:
        backend.close()


def test_a_full_disk_is_logged_once_per_interval_not_per_batch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    backend, disk = faulty_backend(tmp_path, write=WriteRule("write_through"))  # each put a batch of its own
    try:
        disk.mode = "raise"
        with caplog.at_level(logging.ERROR, logger="kvstore.daemon.server.writer"):
            for i in range(5):  # five separate batches, each failing
                _put(backend, keys_for(2, seed=100 + i))
                backend.writer.drain()
        lines = [r.getMessage() for r in caplog.records if r.name == "kvstore.daemon.server.writer"]
        assert len(lines) == 1, lines
        assert "write-behind to the lmdb tier failed: Error: mdb_txn_commit: No space left on device" in lines[0]
        assert backend.writer.failed == 10
    finally:
        backend.close()


def test_sync_always_acknowledges_a_put_only_after_its_disk_write(tmp_path: Path) -> None:
    backend, disk = faulty_backend(tmp_path, durable_puts=True)
    try:
        disk.gate = threading.Event()
        keys = keys_for(3, seed=7)
        result: list[list[bool]] = []
        putter = threading.Thread(target=lambda: result.append(_put(backend, keys)))
        putter.start()
        assert disk.entered.wait(10)  # the writer is inside the disk put, held by the gate
        putter.join(0.3)
        assert putter.is_alive() and not result, "the put was acknowledged before its disk write finished"
        disk.gate.set()
        putter.join(10)
        assert result == [[True] * 3]
        assert all(disk.inner.contains(k) for k in keys)
    finally:
        backend.close()


def test_sync_interval_acknowledges_before_the_disk_write(tmp_path: Path) -> None:
    backend, disk = faulty_backend(tmp_path, durable_puts=False)
    try:
        disk.gate = threading.Event()
        keys = keys_for(3, seed=8)
        assert _put(backend, keys) == [True] * 3  # returns while the writer is still held by the gate
        assert not any(disk.inner.contains(k) for k in keys)
        disk.gate.set()
        assert backend.flush() == 0
        assert all(disk.inner.contains(k) for k in keys)
    finally:
        backend.close()


def test_sync_always_refuses_a_put_whose_disk_write_failed(tmp_path: Path) -> None:
    backend, disk = faulty_backend(tmp_path, durable_puts=True)
    try:
        disk.mode = "raise"
        keys = keys_for(4, seed=9)
        assert _put(backend, keys) == [False] * 4  # not stored durably, so not acknowledged
        assert backend.exists_prefix(keys) == 0  # and not left in host looking stored
        assert backend.flush() == 0  # nothing acknowledged was lost
        assert backend.stats()["write_failures"] == 4 and backend.not_durable == 0
        disk.mode = "ok"
        assert _put(backend, keys) == [True] * 4 and all(disk.inner.contains(k) for k in keys)
    finally:
        backend.close()


def test_sync_always_does_not_call_a_block_being_written_present(tmp_path: Path) -> None:
    backend, disk = faulty_backend(tmp_path, durable_puts=True)
    try:
        disk.gate = threading.Event()
        keys = keys_for(2, seed=10)
        first = threading.Thread(target=lambda: _put(backend, keys))
        first.start()
        assert disk.entered.wait(10)
        # A second client storing the same blocks must not be told "stored" before they are on disk.
        assert [st.name for st, _ in backend.reserve(2, keys)] == ["BUSY", "BUSY"]
        disk.gate.set()
        first.join(10)
        assert [st.name for st, _ in backend.reserve(2, keys)] == ["PRESENT", "PRESENT"]
    finally:
        backend.close()
