"""A flipped bit in an LMDB leaf node's size never takes the process down.

LMDB trusts a node's data size: with bit 23 flipped a 65,584-byte value claims 8,454,192 bytes, and
whatever touches them runs past the end of ``data.mdb`` (``SIGBUS``) or of the map (``SIGSEGV``).
py-lmdb's ``Transaction.get`` touches every page of a value before it returns, so the read died inside
LMDB's bindings. The disk tier now checks each value's size and place against the pages LMDB wrote
before it touches a byte: such a value is a counted, deleted miss whose log names the file and
``kvstore repair``, and ``kvstore repair --salvage`` survives it.

Each read runs in a child process: on a build without the check the child dies of the signal and
the test fails on its exit status instead of taking pytest down.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiers_testlib import make_blocks, make_keys

from kvstore.layout import KVLayout

HERE = str(Path(__file__).parent)
BLOCK64K = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=64, dtype="float16", model_id="b64k")
"""64 KiB blocks: each value (65,584 bytes with its header) on 17 overflow pages, as in the reported run."""
N = 24
F_BIGDATA = 0x01


def flip_size_bit(data_file: Path, key: bytes, bit: int) -> int:
    """Flip ``bit`` of the data size in the ``blocks`` leaf node LMDB reads for ``key`` in ``data_file`` (found
    by LMDB itself: where its cursor's key lies in the map, less the map's start); returns the nodes changed."""
    import lmdb

    from kvstore.tiers.lmdb.value import address_of, file_mappings, new_mapping

    before = file_mappings(str(data_file))
    env = lmdb.open(str(data_file.parent), readonly=True, lock=False, max_dbs=2)
    try:
        base = new_mapping(str(data_file), before)
        assert base is not None, "the map of data.mdb is not in /proc/self/maps"
        with env.begin(db=env.open_db(b"blocks"), buffers=True) as txn:
            cursor = txn.cursor()
            assert cursor.set_key(key)
            node = address_of(cursor.key()) - base - 8  # the node header right before its key
    finally:
        env.close()
    with open(data_file, "r+b") as f:
        f.seek(node)
        lo, hi, flags = struct.unpack("<HHH", f.read(6))
        assert flags & F_BIGDATA, f"the node of {key.hex()[:16]} has flags {flags:#x}: its value is not on overflow pages"
        size = (lo | hi << 16) ^ (1 << bit)
        f.seek(node)
        f.write(struct.pack("<HH", size & 0xFFFF, size >> 16))
    return 1


def filled(path: Path) -> tuple[list[bytes], list[bytes]]:
    """An environment of N 64 KiB blocks; their keys and the blocks' bytes."""
    from kvstore.tiers import DiskTier

    keys, blocks = make_keys(BLOCK64K, N), make_blocks(BLOCK64K, N, seed=3)
    tier = DiskTier(BLOCK64K, path, 16 << 20)
    assert tier.put(keys, blocks) == [True] * N
    tier.close()
    return keys, [b.numpy().tobytes() for b in blocks]


_READ = """
import hashlib, json, sys
sys.path.insert(0, sys.argv[2])
from test_value_bounds import BLOCK64K, N
from tiers_testlib import empty_blocks, make_keys
from kvstore.tiers import DiskTier
tier = DiskTier(BLOCK64K, sys.argv[1], 16 << 20)
keys = make_keys(BLOCK64K, N)
dests = empty_blocks(BLOCK64K, N)
found = tier.get(keys, dests)
again = tier.get(keys, empty_blocks(BLOCK64K, N))
stats = tier.stats()
present = [tier.contains(k) for k in keys]
tier.close()
print(json.dumps({"found": found, "again": again, "present": present, "corrupt": stats.corrupt_dropped,
                  "read_errors": stats.read_errors,
                  "digests": [hashlib.sha256(d.numpy().tobytes()).hexdigest() for d in dests]}))
"""


def read_in_child(path: Path) -> tuple[dict, str]:
    res = subprocess.run([sys.executable, "-c", _READ, str(path), HERE], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"exit {res.returncode} (a negative code is the signal that killed it): {res.stderr[-3000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


@pytest.mark.parametrize("bit", [9, 13, 23, 31], ids=["within-its-pages", "past-the-codec-bound", "past-the-file",
                                                      "past-the-map"])
def test_a_flipped_size_bit_is_a_counted_deleted_miss_never_a_signal(tmp_path: Path, bit: int) -> None:
    import hashlib

    keys, blocks = filled(tmp_path)
    victim = N - 1  # the value nearest the file's end: reading past its pages runs off the file
    assert flip_size_bit(tmp_path / "data.mdb", keys[victim], bit) >= 1
    seen, log = read_in_child(tmp_path)
    assert seen["found"] == [i != victim for i in range(N)]
    assert seen["again"] == seen["found"] and seen["present"] == seen["found"]  # deleted: gone for good
    assert seen["corrupt"] == 1 and seen["read_errors"] == 0
    want = [hashlib.sha256(b).hexdigest() for b in blocks]
    assert all(seen["digests"][i] == want[i] for i in range(N) if i != victim)
    if bit == 9:  # still inside its overflow run: fetched, and the codec's length check drops it
        assert f"{tmp_path}/data.mdb" in log and "length mismatch" in log
    else:
        assert f"{tmp_path}/data.mdb" in log and "kvstore repair" in log and "out of bounds" in log
    after, _ = read_in_child(tmp_path)  # the deletion committed: a new process finds the rest intact
    assert after["found"] == seen["found"] and after["corrupt"] == 0


def test_salvage_survives_a_flipped_size_bit(tmp_path: Path) -> None:
    disk = tmp_path / "lmdb"
    keys, _ = filled(disk)
    assert flip_size_bit(disk / "data.mdb", keys[N - 1], 23) >= 1
    config = tmp_path / "kv.yaml"
    config.write_text(yaml.safe_dump({"model": {"model_id": BLOCK64K.model_id, "num_layers": 2, "num_kv_heads": 2,
                                                "head_dim": 64, "block_size": 64, "dtype": "float16"},
                                      "disk": {"path": str(disk), "max_size": 16 << 20}}))
    res = subprocess.run([sys.executable, "-m", "kvstore", "repair", "--config", str(config), "--salvage"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": HERE})
    assert res.returncode == 0, f"exit {res.returncode}: {res.stdout[-2000:]}{res.stderr[-2000:]}"
    assert f"salvaged {N - 1} blocks" in res.stdout and "1 could not be read" in res.stdout


def test_a_node_is_held_to_its_overflow_run_and_the_file_not_only_to_the_codec_bound(tmp_path: Path) -> None:
    """With the codec's bound out of the way (a huge ``max_value``) the node's own pages still bound it:
    its overflow run, then the pages the file holds. Only node and page headers are read here."""
    import dataclasses

    import lmdb

    from kvstore.tiers.lmdb.value import MapWindow, ValueOutOfBounds, check_node, file_mappings, new_mapping, read_node

    keys, _ = filled(tmp_path)
    assert flip_size_bit(tmp_path / "data.mdb", keys[3], 23) >= 1
    data_file = str(tmp_path / "data.mdb")
    before = file_mappings(data_file)
    env = lmdb.open(str(tmp_path), readonly=True, lock=False, max_dbs=2)
    try:
        base = new_mapping(data_file, before)
        assert base is not None
        with env.begin(db=env.open_db(b"blocks"), buffers=True) as txn:
            window = MapWindow.of(base, int(env.info()["map_size"]), 4096, 1 << 40)
            cursor = txn.cursor()
            for i in (2, 3):
                assert cursor.set_key(keys[i])
                node = read_node(keys[i], cursor.key(), window)
                assert node.run_pages == 17
                if i == 2:
                    check_node(keys[i], node, window)  # intact: passes
                    continue
                with pytest.raises(ValueOutOfBounds, match="8454192 bytes on a run of 17 overflow pages") as info:
                    check_node(keys[i], node, window)
                assert info.value.deletable
            assert cursor.set_key(keys[2])
            intact = read_node(keys[2], cursor.key(), window)
            cut = dataclasses.replace(window, end=intact.addr + 1000)  # as if the file ended inside this value
            with pytest.raises(ValueOutOfBounds, match="65584 bytes run past the pages the file holds"):
                check_node(keys[2], intact, cut)
    finally:
        env.close()
