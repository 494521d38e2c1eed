"""LMDB disk tier read path: cold reads (readahead on and off) stay verified; reads never wait for the writer."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from tiers_testlib import BIG, CODEC_NAMES, empty_blocks, make_blocks, make_keys

from kvstore.bench.rawio import evict_file
from kvstore.tiers.codec import HEADER_SIZE, encode
from kvstore.tiers import DiskTier


def _flip_on_disk(path: Path, stored: bytes, at: int) -> None:
    """Flip one bit of ``stored`` where it lies in ``data.mdb`` (bit rot below LMDB, which LMDB cannot see)."""
    data = bytearray(path.read_bytes())
    where = data.find(stored)
    assert where >= 0 and data.find(stored, where + 1) < 0  # exactly one copy: the overflow pages of the value
    data[where + at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("readahead", [True, False])
@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_cold_get_is_bit_identical_and_catches_bit_rot(tmp_path: Path, codec: str, readahead: bool) -> None:
    keys, blocks = make_keys(BIG, 12), make_blocks(BIG, 12, seed=3)
    tier = DiskTier(BIG, tmp_path, 8 << 20, codec=codec, readahead=readahead)
    assert tier.put(keys, blocks) == [True] * 12
    tier.close()
    stored = encode(blocks[7], codec, 1, BIG.fingerprint, BIG.itemsize, key=keys[7])
    _flip_on_disk(tmp_path / "data.mdb", stored, HEADER_SIZE + (len(stored) - HEADER_SIZE) // 2)
    for name in ("data.mdb", "lock.mdb"):
        evict_file(tmp_path / name)  # the reopened tier reads from the disk, through the cold path
    tier = DiskTier(BIG, tmp_path, 8 << 20, codec=codec, readahead=readahead)
    assert tier.contains_prefix(keys) == 12  # positions on keys only: the damage is not seen (nor read) here
    dests = empty_blocks(BIG, 12)
    assert tier.get(keys, dests) == [i != 7 for i in range(12)]
    assert all(torch.equal(dests[i], blocks[i]) for i in range(12) if i != 7)
    s = tier.stats()
    assert (s.hits, s.misses, s.corrupt_dropped, s.num_blocks) == (11, 1, 1, 11)
    assert [(e.kind, e.key) for e in tier.drain_events()] == [("corrupt", keys[7])]
    assert tier.contains_prefix(keys) == 7
    tier.close()


def test_get_does_not_wait_for_the_writer_and_hits_count_before_eviction(tmp_path: Path) -> None:
    keys, blocks = make_keys(BIG, 40), make_blocks(BIG, 4)
    tier = DiskTier(BIG, tmp_path, 256 << 10)
    n = 0
    while tier.stats().evictions == 0:
        tier.put([keys[n]], [blocks[n % 4]])
        n += 1
    tier.drain_events()
    held = keys[1:n]  # keys[0] was the first victim
    hot = held[:3]
    locked, release = threading.Event(), threading.Event()

    def long_commit() -> None:  # holds the write lock as a put's commit (or fsync) would
        with tier._write_lock:
            locked.set()
            release.wait(10)

    writer = threading.Thread(target=long_commit)
    writer.start()
    assert locked.wait(10)
    reader_done: list[list[bool]] = []
    dests = empty_blocks(BIG, 3)
    reader = threading.Thread(target=lambda: reader_done.append(tier.get(hot, dests)))
    reader.start()
    reader.join(5)
    still_blocked = reader.is_alive()
    release.set()
    writer.join()
    reader.join()
    assert not still_blocked and reader_done == [[True] * 3]
    assert all(torch.equal(d, blocks[(1 + i) % 4]) for i, d in enumerate(dests))
    for i in range(3):  # the queued hits are applied before these puts pick victims
        tier.put([keys[n + i]], [blocks[0]])
    assert [e.key for e in tier.drain_events()] == held[3:6]
    assert tier.contains_prefix(hot) == 3
    tier.close()
