"""File tier: round trips, atomic writes, crash debris, corruption, cap and eviction order (LRU, S3-FIFO) from mtimes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiers_testlib import CODEC_NAMES, LAYOUTS, empty_blocks, make_blocks, make_keys, version_1_value

from kvstore.tiers.codec import encode
from kvstore.config.schema import FileConfig, HostConfig
from kvstore.tiers import TIERS, FileTier, HostTier, build_tier
from kvstore.policy.s3fifo import S3FIFOIndex
from kvstore.policy.order import make_order

L = LAYOUTS["float16"]


@pytest.mark.parametrize("dtype", sorted(LAYOUTS))
@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_round_trip_bit_identical(tmp_path: Path, dtype: str, codec: str) -> None:
    layout = LAYOUTS[dtype]
    tier = FileTier(layout, tmp_path, 1 << 20, codec=codec)
    keys, blocks = make_keys(layout, 4), make_blocks(layout, 4, seed=2)
    assert tier.put_async(keys, blocks).result() == [True] * 4
    dests = empty_blocks(layout, 4)
    assert tier.get_async(keys, dests).result() == [True] * 4
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
    assert os.path.exists(tier.path_of(keys[0])) and tier.path_of(keys[0]).endswith(keys[0].hex() + ".kvb")
    tier.close()


def test_contains_prefix_and_delete(tmp_path: Path) -> None:
    tier = FileTier(L, tmp_path, 1 << 20)
    keys, blocks = make_keys(L, 5), make_blocks(L, 5)
    tier.put(keys[:2] + keys[3:], blocks[:2] + blocks[3:])
    assert tier.contains_prefix(keys) == 2
    assert tier.delete(keys[:1] + keys[2:3]) == 1 and tier.contains_prefix(keys) == 0
    assert sorted(tier.keys()) == sorted([keys[1], keys[3], keys[4]])  # what a full report lists
    tier.close()


def test_crash_debris_is_never_read_and_removed_on_open(tmp_path: Path) -> None:
    tier = FileTier(L, tmp_path, 1 << 20)
    keys, blocks = make_keys(L, 2), make_blocks(L, 2)
    tier.put(keys[:1], blocks[:1])
    half = encode(blocks[1], "none", 1, L.fingerprint, key=keys[1])[:100]
    debris = tier.path_of(keys[1])[:-4] + ".deadbeef.tmp"
    os.makedirs(os.path.dirname(debris), exist_ok=True)
    Path(debris).write_bytes(half)  # a writer died before its rename
    assert not tier.contains(keys[1]) and tier.get(keys[1:], empty_blocks(L, 1)) == [False]
    tier.close()
    reopened = FileTier(L, tmp_path, 1 << 20)
    assert reopened.tmp_removed == 1 and not os.path.exists(debris)
    assert reopened.stats().num_blocks == 1
    reopened.close()


def test_failed_rename_leaves_no_block_under_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import aiofiles.os

    async def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(aiofiles.os, "replace", broken_replace)
    tier = FileTier(L, tmp_path, 1 << 20)
    keys, blocks = make_keys(L, 1), make_blocks(L, 1)
    assert tier.put(keys, blocks) == [False]
    assert not os.path.exists(tier.path_of(keys[0]))
    assert os.listdir(os.path.dirname(tier.path_of(keys[0]))) == []  # the tmp file was removed too
    assert tier.stats().num_blocks == 0
    tier.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "magic", "misplaced", "old format"])
def test_corrupt_file_is_a_counted_deleted_miss(tmp_path: Path, damage: str) -> None:
    tier = FileTier(L, tmp_path, 1 << 20, codec="shuffle_zstd")
    keys, blocks = make_keys(L, 2), make_blocks(L, 2)
    tier.put(keys, blocks)
    path = Path(tier.path_of(keys[0]))
    value = path.read_bytes()
    bad = {
        "flip": value[:60] + bytes([value[60] ^ 4]) + value[61:],
        "truncate": value[:-9],
        "foreign": encode(blocks[0], "none", 1, LAYOUTS["float32"].fingerprint, key=keys[0]),
        "magic": b"ZZZZ" + value[4:],
        # A valid value of another key (here keys[1]'s file) must not be served as keys[0].
        "misplaced": Path(tier.path_of(keys[1])).read_bytes(),
        "old format": version_1_value(blocks[0], L.fingerprint),
    }[damage]
    path.write_bytes(bad)
    assert tier.get(keys, empty_blocks(L, 2)) == [False, True]
    s = tier.stats()
    assert (s.corrupt_dropped, s.misses, s.num_blocks) == (1, 1, 1)
    assert not path.exists() and [(e.kind, e.key) for e in tier.drain_events()] == [("corrupt", keys[0])]
    tier.close()


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_cap_and_lru_from_mtimes(tmp_path: Path, eviction: str) -> None:
    cap = 6 * 4096  # six files of one 4 KiB block each
    tier = FileTier(L, tmp_path, cap, order=make_order(eviction))
    keys, blocks = make_keys(L, 30), make_blocks(L, 1)
    for i in range(24):
        assert tier.put([keys[i]], blocks) == [True]
        on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.kvb"))
        assert on_disk <= cap and tier.stats().used_bytes <= cap
    held = keys[18:24]
    assert [tier.contains(k) for k in held] == [True] * 6 and tier.stats().evictions == 18
    tier.close()
    for rank, key in enumerate(reversed(held)):  # against write order: keys[23] oldest on disk, keys[18] newest
        os.utime(tier.path_of(key), (1_000_000 + rank, 1_000_000 + rank))
    tier = FileTier(L, tmp_path, cap, order=make_order(eviction))
    assert list(tier._lru) == list(reversed(held))  # mtime order (s3fifo: all in main)
    tier.drain_events()
    tier.put(keys[24:26], [blocks[0]] * 2)
    assert [e.key for e in tier.drain_events()] == [keys[23], keys[22]]
    tier.close()


def test_registry_builds_every_tier(tmp_path: Path) -> None:
    assert sorted(TIERS.factories) == ["file", "host", "lmdb", "remote", "slab"]
    tier = build_tier("file", FileConfig(path=str(tmp_path), max_size="1MiB", codec="zstd"), L,
                      order=make_order("s3fifo"))
    assert isinstance(tier, FileTier) and tier.codec == "zstd" and isinstance(tier._lru, S3FIFOIndex)
    tier.close()
    host = build_tier("host", HostConfig(capacity="64KiB", pin_memory="never"), L, auto_evict=False)
    assert isinstance(host, HostTier) and host.num_slots == (64 << 10) // L.bytes_per_block
    with pytest.raises(ValueError, match="known tiers"):
        build_tier("s3", FileConfig(), L)


def test_a_block_evicted_between_its_read_and_the_bookkeeping_is_still_a_hit(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    tier = FileTier(L, tmp_path, 1 << 20)
    keys, blocks = make_keys(L, 2), make_blocks(L, 2)
    tier.put(keys, blocks)
    read_all = tier._read_all

    async def read_then_evicted(*args: object, **kw: object) -> list:
        found = await read_all(*args, **kw)  # type: ignore[arg-type]
        with tier._lock:  # what a concurrent put's eviction does: the order forgets it, the file goes
            tier._lru.remove(keys[0])
        os.unlink(tier.path_of(keys[0]))
        return found

    monkeypatch.setattr(tier, "_read_all", read_then_evicted)
    dests = empty_blocks(L, 2)
    assert tier.get(keys, dests) == [True, True]  # read whole and verified before it went: the bytes are good
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
    assert keys[0] not in tier.keys() and keys[1] in tier.keys()  # not re-added for a file that is gone
    tier.close()
