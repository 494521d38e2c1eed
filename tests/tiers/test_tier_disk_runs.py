"""LMDB disk tier gets split into runs read on several threads at once, still verified."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from tiers_testlib import BIG, empty_blocks, make_blocks, make_keys

import kvstore.tiers.lmdb.reads as reads_module
from kvstore.tiers.codec import HEADER_SIZE, encode
from kvstore.config.schema import DiskConfig
from kvstore.tiers import DiskTier


@pytest.fixture
def two_block_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run is worth a thread from two BIG blocks on (1 MiB in production: too big for a test store)."""
    monkeypatch.setattr(reads_module, "READ_SPLIT_BYTES", 2 * BIG.bytes_per_block)


def test_split_gives_each_thread_a_contiguous_run(tmp_path: Path, two_block_runs: None) -> None:
    tier = DiskTier(BIG, tmp_path, 8 << 20, read_threads=4)
    assert tier._split(10) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert tier._split(5) == [(0, 2), (2, 5)]  # 5 blocks hold only two runs of two
    assert tier._split(3) == [(0, 3)] and tier._split(0) == []
    tier.close()


def test_large_get_reads_runs_on_four_threads_and_drops_a_corrupt_value(
        tmp_path: Path, two_block_runs: None, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, blocks = make_keys(BIG, 12), make_blocks(BIG, 12, seed=5)
    tier = DiskTier(BIG, tmp_path, 8 << 20, read_threads=4)
    assert tier.put(keys, blocks) == [True] * 12
    tier.close()
    stored = encode(blocks[7], "none", 1, BIG.fingerprint, BIG.itemsize, key=keys[7])
    data = bytearray((tmp_path / "data.mdb").read_bytes())
    where = data.find(stored)
    data[where + HEADER_SIZE + 100] ^= 0x01  # bit rot in block 7, in the third run
    (tmp_path / "data.mdb").write_bytes(bytes(data))
    tier = DiskTier(BIG, tmp_path, 8 << 20, read_threads=4)
    seen: dict[int, int] = {}
    real = reads_module.decode_into
    all_four_in_flight = threading.Barrier(4, timeout=10)  # broken (an error) unless the four runs overlap

    def spy(value: object, dest: object, fp: bytes, key: bytes) -> None:
        i = keys.index(key)
        seen[i] = threading.get_ident()
        if i in (0, 3, 6, 9):  # the first block of each run
            all_four_in_flight.wait()
        real(value, dest, fp, key)

    monkeypatch.setattr(reads_module, "decode_into", spy)
    dests = empty_blocks(BIG, 12)
    assert tier.get(keys, dests) == [i != 7 for i in range(12)]
    assert all(torch.equal(dests[i], blocks[i]) for i in range(12) if i != 7)
    runs = [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert [len({seen[i] for i in range(lo, hi)}) for lo, hi in runs] == [1, 1, 1, 1]
    assert seen[0] == threading.get_ident() and threading.get_ident() not in {seen[3], seen[6], seen[9]}
    s = tier.stats()
    assert (s.hits, s.misses, s.corrupt_dropped, s.num_blocks) == (11, 1, 1, 11)
    assert [(e.kind, e.key) for e in tier.drain_events()] == [("corrupt", keys[7])]
    assert tier.contains_prefix(keys) == 7  # deleted
    tier.close()


def test_one_read_thread_reads_on_the_caller(tmp_path: Path, two_block_runs: None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    keys, blocks = make_keys(BIG, 8), make_blocks(BIG, 8)
    tier = DiskTier(BIG, tmp_path, 8 << 20, read_threads=1)
    tier.put(keys, blocks)
    threads: set[int] = set()
    real = reads_module.decode_into
    monkeypatch.setattr(reads_module, "decode_into",
                        lambda *a: (threads.add(threading.get_ident()), real(*a))[1])
    dests = empty_blocks(BIG, 8)
    assert tier.get(keys, dests) == [True] * 8 and threads == {threading.get_ident()}
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
    tier.close()


def test_read_threads_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk.read_threads must be at least 1, got 0"):
        DiskTier(BIG, tmp_path, 8 << 20, read_threads=0)
    with pytest.raises(ValueError, match="read_threads"):
        DiskConfig(path=str(tmp_path), read_threads=0)
    assert DiskConfig(path=str(tmp_path)).read_threads == 4
