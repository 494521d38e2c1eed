"""The machine-limit probes of the tiers suite: the parallel O_DIRECT read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.bench.rawio import RAW_FILE, buffered_write_gbps, direct_io_gbps, parallel_read_gbps


def test_parallel_read_reads_every_request_and_refuses_a_short_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    assert parallel_read_gbps(path, 1 << 20, 64 << 10, 4) > 0
    with pytest.raises(OSError, match=f"short read from {path}"):
        parallel_read_gbps(path, 2 << 20, 64 << 10, 4)


def test_direct_io_reports_the_best_parallel_read_and_its_shape(tmp_path: Path) -> None:
    r = direct_io_gbps(tmp_path, 1 << 20, parallel_request=5000, parallel_threads=(2, 4))
    assert r.parallel_read_gbps is not None and r.parallel_read_gbps > 0
    assert r.parallel_threads in (2, 4) and r.parallel_request == 8192  # rounded up to pages for O_DIRECT
    assert list(tmp_path.iterdir()) == []  # the probe file is removed
    plain = direct_io_gbps(tmp_path, 1 << 20)
    assert (plain.parallel_read_gbps, plain.parallel_threads, plain.parallel_request) == (None, None, None)


def test_buffered_write_keeps_its_file_whole_and_direct_io_keeps_its_file_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "buffered.bench"
    assert buffered_write_gbps(path, 1 << 20) > 0
    assert path.stat().st_size == 16 << 20  # rounded up to one CHUNK, kept (its pages stay in the page cache)
    direct_io_gbps(tmp_path, 1 << 20)
    assert not (tmp_path / RAW_FILE).exists()
    direct_io_gbps(tmp_path, 1 << 20, keep=True)
    assert (tmp_path / RAW_FILE).stat().st_size == 16 << 20
