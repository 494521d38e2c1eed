"""Slab disk tier: round trips, restart in another process, damage in the data file, cap and LRU order,
kill -9 during puts, config refusals. The contract shared with the other tiers is in
tests/remote/test_tier_contract.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiers_testlib import BIG, LAYOUTS, empty_blocks, make_blocks, make_keys

from kvstore.config import ConfigError, load_config
from kvstore.errors import TierError
from kvstore.tiers import SlabTier, build_tier
from kvstore.tiers.slab.data_file import Run, runs

HERE = str(Path(__file__).parent)


def open_slab(path: Path, layout=BIG, slots: int = 64, **kw: object) -> SlabTier:  # type: ignore[no-untyped-def]
    probe = SlabTier(layout, path, 1 << 30, **kw)  # type: ignore[arg-type]
    size = probe.slot_size
    probe.close()
    return SlabTier(layout, path, slots * size, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", [*LAYOUTS.values(), BIG], ids=[*LAYOUTS, "big"])
@pytest.mark.parametrize("sync", ["always", "interval"])
def test_round_trip_bit_identical(tmp_path: Path, layout, sync: str) -> None:  # type: ignore[no-untyped-def]
    tier = open_slab(tmp_path, layout, sync=sync)
    keys, blocks = make_keys(layout, 20), make_blocks(layout, 20, seed=5)
    assert tier.put(keys[:7], blocks[:7]) == [True] * 7 and tier.put(keys[7:], blocks[7:]) == [True] * 13
    dests = empty_blocks(layout, 21)
    assert tier.get(list(reversed(keys)) + make_keys(layout, 1, seed=9), dests) == [True] * 20 + [False]
    assert all(torch.equal(d, b) for d, b in zip(dests, reversed(blocks)))
    s = tier.stats()
    assert (s.hits, s.misses, s.puts, s.num_blocks, s.used_bytes) == (20, 1, 20, 20, 20 * tier.slot_size)
    assert tier.slot_size % 4096 == 0 and tier.slot_size >= layout.bytes_per_block + 48
    tier.check_integrity()
    tier.close()


def test_runs_group_consecutive_slots_and_cap_their_length() -> None:
    assert runs([5, 3, 4, 9, 6], 3) == [Run(3, (1, 2, 0)), Run(6, (4,)), Run(9, (3,))]
    assert runs([], 4) == []


def test_a_batch_is_written_to_consecutive_slots_with_o_direct(tmp_path: Path) -> None:
    tier = open_slab(tmp_path)
    keys = make_keys(BIG, 10)
    tier.put(keys, make_blocks(BIG, 10))
    assert [tier._slots[k] for k in keys] == list(range(10))
    assert tier.data.direct  # ext4 / xfs; tmpfs would fall back to buffered
    tier.close()


_WRITER = """
import os, sys
sys.path.insert(0, sys.argv[3])
from tiers_testlib import BIG, make_blocks, make_keys
from kvstore.tiers import SlabTier
tier = SlabTier(BIG, sys.argv[1], 4 << 20, sync=sys.argv[2], sync_interval_ms=60_000)
tier.put(make_keys(BIG, 30), make_blocks(BIG, 30, seed=11))
if sys.argv[2] == "interval":
    tier.flush()
os._exit(0)  # no close(): what was acknowledged (and flushed) must already be on disk
"""

_READER = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from tiers_testlib import BIG, empty_blocks, make_blocks, make_keys
from kvstore.tiers import SlabTier
tier = SlabTier(BIG, sys.argv[1], 4 << 20)
keys, blocks = make_keys(BIG, 30), make_blocks(BIG, 30, seed=11)
assert tier.contains_prefix(keys) == 30
dests = empty_blocks(BIG, 30)
assert tier.get(keys, dests) == [True] * 30
assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
tier.check_integrity()
print("ok", tier.stats().num_blocks)
"""


@pytest.mark.parametrize("sync", ["always", "interval"])
def test_restart_in_another_process_serves_every_block(tmp_path: Path, sync: str) -> None:
    subprocess.run([sys.executable, "-c", _WRITER, str(tmp_path), sync, HERE], check=True)
    out = subprocess.run([sys.executable, "-c", _READER, str(tmp_path), HERE], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["ok", "30"]


def _damage_flip(tier: SlabTier, key: bytes, other: bytes) -> None:
    with open(tier.data.path, "r+b") as f:
        f.seek(tier._slots[key] * tier.slot_size + 3000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def _damage_truncate(tier: SlabTier, key: bytes, other: bytes) -> None:
    os.truncate(tier.data.path, tier._slots[key] * tier.slot_size + 100)  # the key's slot is the last one


def _damage_overwrite(tier: SlabTier, key: bytes, other: bytes) -> None:
    with open(tier.data.path, "r+b") as f:
        f.seek(tier._slots[other] * tier.slot_size)
        value = f.read(tier.slot_size)
        f.seek(tier._slots[key] * tier.slot_size)
        f.write(value)  # another key's valid value, byte for byte


@pytest.mark.parametrize("damage", [_damage_flip, _damage_truncate, _damage_overwrite], ids=["flip", "truncate", "other-key"])
@pytest.mark.parametrize("reopen", [False, True], ids=["open", "reopened"])
def test_damaged_data_file_is_a_counted_deleted_miss(tmp_path: Path, damage, reopen: bool) -> None:  # type: ignore[no-untyped-def]
    tier = open_slab(tmp_path)
    keys, blocks = make_keys(BIG, 4), make_blocks(BIG, 4)
    tier.put(keys, blocks)
    damage(tier, keys[3], keys[0])
    if reopen:
        tier.close()
        tier = open_slab(tmp_path)
    tier.drain_events()
    dests = empty_blocks(BIG, 4)
    assert tier.get(keys, dests) == [True, True, True, False]
    assert all(torch.equal(d, b) for d, b in zip(dests[:3], blocks[:3]))
    s = tier.stats()
    assert (s.corrupt_dropped, s.misses, s.hits, s.num_blocks) == (1, 1, 3, 3)
    assert [(e.kind, e.key) for e in tier.drain_events()] == [("corrupt", keys[3])]
    assert not tier.contains(keys[3]) and tier.get(keys[3:], empty_blocks(BIG, 1)) == [False]
    tier.check_integrity()
    assert tier.put(keys[3:], blocks[3:]) == [True]  # a clean copy goes back in
    assert tier.get(keys[3:], dests[3:]) == [True] and torch.equal(dests[3], blocks[3])
    tier.close()
    tier = open_slab(tmp_path)  # the deletion reached the index: nothing stale after a restart
    assert tier.get(keys, empty_blocks(BIG, 4)) == [True] * 4 and tier.stats().corrupt_dropped == 0
    tier.close()


def test_capacity_is_never_exceeded_and_lru_order_is_exact(tmp_path: Path) -> None:
    tier = open_slab(tmp_path, slots=4)
    keys, blocks = make_keys(BIG, 8), make_blocks(BIG, 8)
    tier.put(keys[:4], blocks[:4])
    assert tier.keys() == [keys[3], keys[2], keys[1], keys[0]]  # a batch is used last key first
    tier.get([keys[3]], empty_blocks(BIG, 1))  # keys[3] becomes the most recent
    tier.drain_events()
    assert tier.put(keys[4:6], blocks[4:6]) == [True, True]
    assert [(e.kind, e.key) for e in tier.drain_events()] == [("evicted", keys[2]), ("evicted", keys[1])]
    assert tier.keys() == [keys[0], keys[3], keys[5], keys[4]]
    for n in range(6, 8):
        tier.put(keys[n : n + 1], blocks[n : n + 1])
        assert tier.stats().num_blocks <= 4 and len(set(tier._slots.values())) == len(tier._slots)
        tier.check_integrity()
    assert tier.keys() == [keys[5], keys[4], keys[6], keys[7]] and tier.stats().evictions == 4
    dests = empty_blocks(BIG, 4)
    order = [keys[5], keys[4], keys[6], keys[7]]
    assert tier.get(order, dests) == [True] * 4
    assert all(torch.equal(d, blocks[keys.index(k)]) for d, k in zip(dests, order))
    assert os.path.getsize(tier.data.path) <= 4 * tier.slot_size
    tier.close()
    tier = open_slab(tmp_path, slots=4)  # the order survives a restart (access counters in the index)
    assert tier.keys() == [keys[7], keys[6], keys[4], keys[5]]
    tier.close()


def test_reopen_with_fewer_slots_drops_the_entries_past_them(tmp_path: Path) -> None:
    tier = open_slab(tmp_path, slots=8)
    keys, blocks = make_keys(BIG, 8), make_blocks(BIG, 8)
    tier.put(keys, blocks)
    tier.close()
    tier = open_slab(tmp_path, slots=3)
    assert sorted(tier._slots.values()) == [0, 1, 2] and tier.contains_prefix(keys) == 3
    tier.check_integrity()
    tier.close()


_KILLED = """
import sys
sys.path.insert(0, sys.argv[3])
from tiers_testlib import BIG, make_blocks, make_keys
from kvstore.tiers import SlabTier
tier = SlabTier(BIG, sys.argv[1], 24 * 8192, sync=sys.argv[2], sync_interval_ms=5)
keys, blocks = make_keys(BIG, 4000), make_blocks(BIG, 16, seed=3)
for r in range(0, 4000, 8):
    tier.put(keys[r : r + 8], [blocks[(r + j) % 16] for j in range(8)])
    if sys.argv[2] == "interval":
        tier.flush()
    print(r, flush=True)
"""


@pytest.mark.parametrize("sync", ["always", "interval"])
def test_kill9_during_puts_keeps_every_acknowledged_block_and_serves_nothing_wrong(tmp_path: Path, sync: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(tmp_path), sync, HERE], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    acked = [int(proc.stdout.readline()) for _ in range(40)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # Rounds the child acknowledged while this process was reading: under load it runs several rounds ahead,
    # and three rounds after the 40th evict it (the cap), so the last acknowledged round is the last printed.
    acked += [int(line) for line in proc.stdout.read().split()]
    last = acked[-1]
    keys, blocks = make_keys(BIG, 4000), make_blocks(BIG, 16, seed=3)
    tier = SlabTier(BIG, tmp_path, 24 * 8192)
    tier.check_integrity()
    # The cap holds 24 blocks (3 rounds); the last acknowledged round was never a victim.
    assert tier.contains_prefix(keys[last : last + 8]) == 8
    dests = empty_blocks(BIG, len(keys[: last + 64]))
    found = tier.get(keys[: last + 64], dests)
    assert all(found[last : last + 8])
    for i, ok in enumerate(found):
        if ok:
            assert torch.equal(dests[i], blocks[i % 16]), i
    tier.close()


def test_only_the_none_codec_and_one_disk_tier_are_accepted(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [host, slab]\nslab:\n  codec: zstd\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad, environ={})
    assert "slab.codec" in str(info.value) and str(bad) in str(info.value)
    two = tmp_path / "two.yaml"
    two.write_text("tiers: [host, lmdb, slab]\n")
    with pytest.raises(ConfigError, match="choose one disk tier of lmdb, file, slab, not lmdb and slab") as info:
        load_config(two, environ={})
    assert str(two) in str(info.value)
    with pytest.raises(ValueError, match="slab.codec must be 'none'"):
        SlabTier(BIG, tmp_path / "t", 1 << 20, codec="zstd")
    with pytest.raises(TierError, match="slab.max_size"):
        SlabTier(BIG, tmp_path / "t", 4096)


def test_built_by_name_from_its_section(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(f"tiers: [host, slab]\nslab:\n  path: {tmp_path / 'slab'}\n  max_size: 1MiB\n")
    cfg = load_config(good, environ={})
    tier = build_tier("slab", cfg.slab, BIG)
    assert isinstance(tier, SlabTier) and tier.capacity == (1 << 20) // tier.slot_size
    with pytest.raises(TierError, match="slab.path"):
        build_tier("slab", cfg.slab, BIG)  # one process (here: one tier) per directory
    tier.close()
    assert cfg.for_role("demo").slab.path == str(tmp_path / "slab")
    assert load_config(tmp_path / "good.yaml", environ={}).model_copy(update={"slab": cfg.slab.model_copy(
        update={"path": None})}).for_role("demo").slab.path == ".kvstore-data/demo/slab"


def test_a_damaged_index_is_refused_naming_the_file_and_slab_path(tmp_path: Path) -> None:
    tier = open_slab(tmp_path)
    tier.put(make_keys(BIG, 2), make_blocks(BIG, 2))
    tier.close()
    (tmp_path / "index" / "data.mdb").write_bytes(b"garbage" * 2000)
    with pytest.raises(TierError, match=r"index/data.mdb is not an LMDB data file.*\(slab.path\) aside"):
        SlabTier(BIG, tmp_path, 1 << 20)
    (tmp_path / "index" / "data.mdb").unlink()
    SlabTier(BIG, tmp_path, 1 << 20).close()  # the directory lock was released by the refusal


def test_a_failed_write_changes_nothing_and_the_tier_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = open_slab(tmp_path, slots=4)
    keys, blocks = make_keys(BIG, 6), make_blocks(BIG, 6)
    tier.put(keys[:4], blocks[:4])

    def fail(first: int, data: memoryview) -> None:
        raise TierError("injected ENOSPC")

    monkeypatch.setattr(tier.data, "write", fail)
    with pytest.raises(TierError, match="injected"):
        tier.put(keys[4:], blocks[4:])
    tier.check_integrity()
    assert tier.keys() == [keys[3], keys[2], keys[1], keys[0]] and tier.stats().evictions == 0
    monkeypatch.undo()
    assert tier.put(keys[4:], blocks[4:]) == [True, True]
    dests, kept = empty_blocks(BIG, 4), [0, 1, 4, 5]  # the victims: keys[3] and keys[2], the oldest
    assert tier.get([keys[i] for i in kept], dests) == [True] * 4 and not tier.contains_prefix(keys[2:4])
    assert all(torch.equal(d, blocks[i]) for d, i in zip(dests, kept))
    tier.check_integrity()
    tier.close()


def test_gets_racing_evicting_puts_never_serve_wrong_bytes(tmp_path: Path) -> None:
    import threading

    tier = open_slab(tmp_path, slots=16)
    keys, blocks = make_keys(BIG, 400), make_blocks(BIG, 8)
    done = threading.Event()
    wrong: list[int] = []

    def reader() -> None:
        dests = empty_blocks(BIG, 8)
        while not done.is_set():
            for lo in range(0, 400, 8):
                for i, ok in enumerate(tier.get(keys[lo : lo + 8], dests)):
                    if ok and not torch.equal(dests[i], blocks[(lo + i) % 8]):
                        wrong.append(lo + i)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for lo in range(0, 400, 4):  # every put evicts (16 slots): victims' slots are rewritten at once
        tier.put(keys[lo : lo + 4], [blocks[(lo + j) % 8] for j in range(4)])
    done.set()
    for t in threads:
        t.join()
    assert wrong == [] and tier.stats().evictions == 400 - 16
    tier.check_integrity()
    tier.close()
