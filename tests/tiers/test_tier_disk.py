"""LMDB disk tier: round trips, restart in another process, corruption, cap, LRU persistence."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import lmdb
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers_testlib import BIG, CODEC_NAMES, LAYOUTS, empty_blocks, make_blocks, make_keys, version_1_value

from kvstore.tiers.codec import encode
from kvstore.config.schema import DiskConfig
from kvstore.errors import TierError
from kvstore.tiers import DiskTier, build_tier
from kvstore.tiers.lmdb import tier as disk_module
from kvstore.policy.s3fifo import S3FIFOIndex
from kvstore.policy.order import make_order

L = LAYOUTS["float16"]
EVICTIONS = ("lru", "s3fifo", "gdsf")


def open_disk(path: Path, layout=L, max_size: int = 32 << 20, eviction: str | None = None,  # type: ignore[no-untyped-def]
              **kw: object) -> DiskTier:
    """A disk tier; ``eviction``: the name of the order to hand it (:func:`make_order`), else LRU."""
    order = make_order(eviction) if eviction is not None else None
    return DiskTier(layout, path, max_size, order=order, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", sorted(LAYOUTS))
@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_round_trip_bit_identical(tmp_path: Path, dtype: str, codec: str) -> None:
    layout = LAYOUTS[dtype]
    tier = open_disk(tmp_path, layout, codec=codec, codec_level=3)
    keys, blocks = make_keys(layout, 6), make_blocks(layout, 6, seed=5)
    assert tier.put_async(keys, blocks).result() == [True] * 6
    dests = empty_blocks(layout, 7)
    assert tier.get_async(keys + make_keys(layout, 1, seed=9), dests).result() == [True] * 6 + [False]
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
    s = tier.stats()
    assert (s.hits, s.misses, s.puts, s.num_blocks) == (6, 1, 6, 6)
    tier.close()


def test_contains_prefix_counts_until_gap(tmp_path: Path) -> None:
    tier = open_disk(tmp_path)
    keys, blocks = make_keys(L, 6), make_blocks(L, 6)
    tier.put(keys[:2] + keys[3:], blocks[:2] + blocks[3:])
    assert tier.contains_prefix(keys) == 2
    assert tier.contains_prefix(keys[3:]) == 3
    assert tier.contains(keys[5]) and not tier.contains(keys[2])
    assert tier.delete([keys[0], keys[2]]) == 1 and tier.contains_prefix(keys) == 0
    tier.close()
    with pytest.raises(TierError, match="closed"):
        tier.put(keys[:1], blocks[:1])


_WRITER = """
import os, sys
sys.path.insert(0, sys.argv[3])
from tiers_testlib import LAYOUTS, make_blocks, make_keys
from kvstore.tiers import DiskTier
L = LAYOUTS["bfloat16"]
tier = DiskTier(L, sys.argv[1], 32 << 20, codec="shuffle_zstd", sync=sys.argv[2], sync_interval_ms=60_000)
tier.put(make_keys(L, 20), make_blocks(L, 20, seed=11))
if sys.argv[2] == "interval":
    tier.flush()
os._exit(0)  # no close(): what was acknowledged (and flushed) must already be on disk
"""

_READER = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from tiers_testlib import LAYOUTS, empty_blocks, make_blocks, make_keys
from kvstore.tiers import DiskTier
L = LAYOUTS["bfloat16"]
tier = DiskTier(L, sys.argv[1], 32 << 20)
keys, blocks = make_keys(L, 20), make_blocks(L, 20, seed=11)
assert tier.contains_prefix(keys) == 20
dests = empty_blocks(L, 20)
assert tier.get(keys, dests) == [True] * 20
assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
print("ok", tier.stats().num_blocks)
"""


@pytest.mark.parametrize("sync", ["always", "interval"])
def test_restart_in_another_process_reads_bit_identical(tmp_path: Path, sync: str) -> None:
    here = str(Path(__file__).parent)
    subprocess.run([sys.executable, "-c", _WRITER, str(tmp_path), sync, here], check=True)
    out = subprocess.run([sys.executable, "-c", _READER, str(tmp_path), here], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["ok", "20"]


def _tamper(tier: DiskTier, key: bytes, fn, other: bytes) -> None:  # type: ignore[no-untyped-def]
    """Replace ``key``'s value with ``fn(its value, the value stored under other)``."""
    with tier.env.begin(write=True) as txn:
        value, other_value = bytes(txn.get(key, db=tier._blocks)), bytes(txn.get(other, db=tier._blocks))
        txn.put(key, fn(value, other_value), db=tier._blocks)


_DAMAGE = {
    "flip": lambda v, _: v[:100] + bytes([v[100] ^ 0x01]) + v[101:],
    "truncate": lambda v, _: v[: len(v) // 2],
    "foreign fingerprint": lambda v, _: encode(make_blocks(L, 1)[0], "none", 1, LAYOUTS["bfloat16"].fingerprint, key=bytes(32)),
    "unknown version": lambda v, _: v[:4] + struct.pack("<H", 99) + v[6:],
    "bad magic": lambda v, _: b"JUNK" + v[4:],
    # Another key's valid value, byte for byte.
    "misplaced": lambda v, first: first,
    "old format": lambda v, _: version_1_value(make_blocks(L, 1)[0], L.fingerprint),
}


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_corrupt_value_is_a_counted_deleted_miss(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    tier = open_disk(tmp_path, codec="zstd")
    keys, blocks = make_keys(L, 3), make_blocks(L, 3)
    tier.put(keys, blocks)
    _tamper(tier, keys[1], _DAMAGE[damage], other=keys[0])
    dests = empty_blocks(L, 3)
    assert tier.get(keys, dests) == [True, False, True]
    s = tier.stats()
    assert (s.corrupt_dropped, s.misses, s.hits, s.num_blocks) == (1, 1, 2, 2)
    assert [(e.kind, e.key) for e in tier.drain_events()] == [("corrupt", keys[1])]
    assert f"dropped a corrupt value in {tmp_path}/data.mdb: corrupt block {keys[1][:8].hex()}" in caplog.text
    if damage in ("old format", "misplaced"):
        assert {"old format": "old format", "misplaced": "checksum mismatch"}[damage] in caplog.text
    with tier.env.begin(db=tier._blocks) as txn:
        assert txn.get(keys[1]) is None
    assert tier.contains_prefix(keys) == 1
    assert tier.put(keys[1:2], blocks[1:2]) == [True]  # a clean copy can be stored again
    assert tier.get(keys[1:2], dests[1:2]) == [True] and torch.equal(dests[1], blocks[1])
    tier.close()


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_lru_order_survives_reopen(tmp_path: Path, eviction: str) -> None:
    keys, blocks = make_keys(BIG, 40), make_blocks(BIG, 4)
    tier = open_disk(tmp_path, BIG, max_size=256 << 10, eviction=eviction)
    n = 0
    while tier.stats().evictions == 0:
        tier.put([keys[n]], [blocks[n % 4]])
        n += 1
    tier.drain_events()
    held = keys[1:n]  # keys[0] was the first victim
    hot = held[:3]
    tier.get(hot, empty_blocks(BIG, 3))
    tier.close()
    tier = open_disk(tmp_path, BIG, max_size=256 << 10, eviction=eviction)
    assert tier.stats().num_blocks == len(held)
    # Access order, a batch's last key first (a chain's head ends up most recent); s3fifo: all in main.
    assert list(tier._lru) == held[3:] + hot[::-1]
    for i in range(3):
        tier.put([keys[n + i]], [blocks[0]])
    assert [e.key for e in tier.drain_events()] == held[3:6]
    assert tier.contains_prefix(hot) == 3
    tier.close()


def test_map_grows_in_steps_up_to_the_cap(tmp_path: Path) -> None:
    tier = open_disk(tmp_path, BIG, max_size=1 << 20, map_step=128 << 10)
    assert tier.map_size() == 128 << 10
    keys, blocks = make_keys(BIG, 200), make_blocks(BIG, 1)
    for i in range(0, 200, 5):
        assert tier.put(keys[i : i + 5], blocks * 5) == [True] * 5
    assert tier.map_size() == 1 << 20
    assert os.path.getsize(tmp_path / "data.mdb") <= 1 << 20
    tier.close()


@pytest.mark.parametrize("sync", ["interval", "always"])
def test_put_commits_in_bounded_transactions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: str) -> None:
    """Under ``interval`` a large put is committed in transactions of about TXN_BYTES (LMDB commits large
    ones several times slower, docs/BENCHMARKS.md); under ``always`` in one, so the batch pays one fsync."""
    monkeypatch.setattr(disk_module, "TXN_BYTES", 3 * BIG.bytes_per_block)
    tier = open_disk(tmp_path, BIG, max_size=8 << 20, sync=sync)
    keys, blocks = make_keys(BIG, 10), make_blocks(BIG, 10)
    before = tier.env.info()["last_txnid"]
    assert tier.put(keys, blocks) == [True] * 10
    # each chunk closes once it holds TXN_BYTES of values (a value is a block plus its header): 3, 3, 3, 1
    assert tier.env.info()["last_txnid"] - before == (4 if sync == "interval" else 1)
    tier.close()
    tier = open_disk(tmp_path, BIG, max_size=8 << 20, sync=sync)
    dests = empty_blocks(BIG, 10)
    assert tier.get(keys, dests) == [True] * 10
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
    tier.close()


@pytest.mark.parametrize("sync", ["interval", "always"])
def test_put_larger_than_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: str) -> None:
    """A batch bigger than the whole tier (cut into transactions under ``interval``): its first blocks are
    stored, none evicted by a later part of the same batch, the cap holds, every stored block reads back,
    and the eviction reserve is left for the access records that reads and close then commit."""
    monkeypatch.setattr(disk_module, "TXN_BYTES", 4 * BIG.bytes_per_block)
    cap = 384 << 10
    tier = open_disk(tmp_path, BIG, max_size=cap, map_step=64 << 10, sync=sync)
    keys, blocks = make_keys(BIG, 100), make_blocks(BIG, 100)
    ok = tier.put(keys, blocks)
    stored = sum(ok)
    assert 0 < stored < 100 and ok == [True] * stored + [False] * (100 - stored)
    assert os.path.getsize(tmp_path / "data.mdb") <= cap and tier.stats().used_bytes <= cap
    dests = empty_blocks(BIG, 100)
    assert tier.get(keys, dests) == ok
    assert all(torch.equal(d, b) for d, b, hit in zip(dests, blocks, ok) if hit)
    tier.close()


@given(
    ops=st.lists(
        st.tuples(st.sampled_from("ppgd"), st.lists(st.integers(0, 119), min_size=1, max_size=6)),
        min_size=20,
        max_size=60,
    ),
    codec=st.sampled_from(CODEC_NAMES),
)
@settings(max_examples=12, deadline=None)
@pytest.mark.parametrize("eviction", EVICTIONS)
def test_cap_never_exceeded_under_random_workload(ops: list[tuple[str, list[int]]], codec: str, eviction: str) -> None:
    cap = 384 << 10
    keys = make_keys(BIG, 120)
    blocks = make_blocks(BIG, 6)
    with tempfile.TemporaryDirectory() as tmp:
        tier = open_disk(Path(tmp), BIG, max_size=cap, codec=codec, map_step=64 << 10, sync="interval",
                         eviction=eviction)
        for op, idx in ops:
            batch = [keys[i] for i in idx]
            if op == "p":
                assert tier.put(batch, [blocks[i % 6] for i in idx]) == [True] * len(idx)  # never MapFullError
            elif op == "g":
                dests = empty_blocks(BIG, len(idx))
                for i, d, ok in zip(idx, dests, tier.get(batch, dests)):
                    assert not ok or torch.equal(d, blocks[i % 6])
            else:
                tier.delete(batch)
            assert os.path.getsize(os.path.join(tmp, "data.mdb")) <= cap
            assert tier.stats().used_bytes <= cap and tier.map_size() <= cap
        tier.close()


def test_build_from_config_and_tiny_cap_rejected(tmp_path: Path) -> None:
    section = DiskConfig(path=str(tmp_path / "db"), max_size="4MiB", codec="shuffle_zstd", sync="always")
    tier = build_tier("lmdb", section, L, order=make_order("s3fifo"))
    assert isinstance(tier, DiskTier) and tier.codec == "shuffle_zstd" and tier.sync_mode == "always"
    assert isinstance(tier._lru, S3FIFOIndex)
    tier.close()
    with pytest.raises(TierError, match="cannot hold one block"):
        DiskTier(BIG, tmp_path / "tiny", 8192)
    assert lmdb.version() >= (0, 9)
