"""Damaged LMDB pages never take the daemon down: zeroed pages at start, a flipped node size at a get.

LMDB meets a page that is neither a leaf nor a branch with ``abort()`` inside
``mdb_cursor_next`` (``Assertion 'IS_LEAF(mp)'``), which the daemon's start
hits while it reads its access records. The daemon walks its databases in a
child first and refuses to start, naming ``data.mdb`` and ``kvstore repair``;
the salvage then keeps every block that still verifies and the daemon starts.

A flipped bit in a leaf node's size sends LMDB's value past its page and the file: the daemon checks
every value's place before it touches it (:mod:`kvstore.tiers.lmdb.value`), so the block is a counted
miss and every other client keeps being served.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import torch
from daemonlib import REPO, block_for, cleanup, empty_blocks, keys_for, short_tmpdir, start_daemon, write_config

from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.client.tier import DaemonTier
from kvstore.layout import KVLayout


def zero_access_record_pages(data_file: Path, keys: list[bytes], page_size: int = 4096) -> int:
    """Zero every ``lru`` leaf page (16-byte values) of ``data_file`` but those holding the smallest key.

    The first leaf in key order stays intact, so a cursor walk starts and then steps onto a zeroed page
    (neither leaf nor branch): LMDB's ``IS_LEAF`` assertion. Stale copies (copy-on-write leftovers) are
    zeroed too, which changes nothing LMDB reads. A key counts only where a node pointer of the page
    (``uint16`` offsets from byte 16 up to ``mp_lower`` at byte 12) points at its node: a page LMDB reused
    (its free list, its main database) keeps stale keys in its free space, and zeroing it would damage
    what the daemon reads at open, not the access records. Returns how many pages were zeroed."""
    data = bytearray(data_file.read_bytes())
    first = min(keys)
    zeroed = 0
    for start in range(0, len(data) - page_size + 1, page_size):
        page = data[start : start + page_size]
        if first in page or not struct.unpack_from("<H", page, 10)[0] & 0x02:  # P_LEAF pages only
            continue
        lower = struct.unpack_from("<H", page, 12)[0]
        nodes = set(struct.unpack_from(f"<{max(0, lower - 16) // 2}H", page, 16)) if 16 <= lower <= page_size else set()
        for key in keys:
            at = page.find(key)
            if at >= 24 and at - 8 in nodes:
                lo, hi, flags = struct.unpack_from("<HHH", page, at - 8)
                if (lo | hi << 16) == 16 and not flags & 1:
                    data[start : start + page_size] = bytes(page_size)
                    zeroed += 1
                break
    data_file.write_bytes(bytes(data))
    return zeroed


def put_flushed(tier: DaemonTier, n: int, seed: int) -> list[bytes]:
    """Put ``n`` blocks through ``tier`` in batches of 50 and FLUSH them; their keys."""
    keys = keys_for(n, seed=seed)
    for i in range(0, n, 50):
        assert tier.put(keys[i : i + 50], [block_for(k) for k in keys[i : i + 50]]) == [True] * len(keys[i : i + 50])
    tier.flush()
    return keys


def test_zeroed_pages_refuse_the_start_with_a_message_and_salvage_recovers() -> None:
    root = short_tmpdir()
    d = None
    try:
        config = write_config(root, host={"capacity": 512 * 64})
        d = start_daemon(config)
        tier = d.tier()
        keys = put_flushed(tier, 400, seed=81)
        tier.close()
        assert d.stop() == 0
        assert zero_access_record_pages(root / "lmdb" / "data.mdb", keys) >= 2

        out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(config)],
                             capture_output=True, text=True, cwd=REPO, timeout=120)
        assert out.returncode == 1, (out.returncode, out.stderr[-2000:])  # refused, not killed by SIGABRT
        assert f"{root / 'lmdb' / 'data.mdb'} has a damaged page" in out.stderr and "kvstore repair" in out.stderr

        rep = subprocess.run([sys.executable, "-m", "kvstore", "repair", "--config", str(config), "--salvage"],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
        assert rep.returncode == 0, rep.stdout + rep.stderr
        d = start_daemon(config)
        tier = d.tier()
        dests = empty_blocks(len(keys))
        found = tier.get(keys, dests)
        assert all(bool((b == block_for(k)).all()) for k, b, ok in zip(keys, dests, found) if ok)  # nothing wrong served
        assert sum(found) > 0
        tier.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


MODEL_64K = {"model_id": "daemon-64k", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 64,
             "dtype": "float16"}
LAYOUT_64K = KVLayout(**MODEL_64K)
"""64 KiB blocks, as in the reported run: each value on a run of 17 overflow pages."""


def noise_for(key: bytes) -> torch.Tensor:
    """Incompressible block content derived from ``key``."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return torch.randint(0, 256, (LAYOUT_64K.bytes_per_block,), dtype=torch.uint8, generator=gen)


def flip_big_node_size(data_file: Path, key: bytes, bit: int, page_size: int = 4096) -> int:
    """Flip ``bit`` of the size of every leaf node of ``key`` whose value is on overflow pages; how many."""
    data = bytearray(data_file.read_bytes())
    changed = 0
    for start in range(0, len(data) - page_size + 1, page_size):
        at = data.find(key, start, start + page_size)
        if at - start < 24 or not struct.unpack_from("<H", data, start + 10)[0] & 0x02:
            continue
        lo, hi, flags = struct.unpack_from("<HHH", data, at - 8)
        if flags & 1:  # F_BIGDATA
            size = (lo | hi << 16) ^ 1 << bit
            struct.pack_into("<HH", data, at - 8, size & 0xFFFF, size >> 16)
            changed += 1
    data_file.write_bytes(bytes(data))
    return changed


def test_a_flipped_node_size_is_a_counted_miss_and_the_daemon_serves_on() -> None:
    root = short_tmpdir()
    d = None

    def connect() -> DaemonTier:
        c = DaemonClient(LAYOUT_64K, socket_path=d.socket_path)
        c.connect(10)
        return DaemonTier(LAYOUT_64K, c)

    try:
        config = write_config(root, model=MODEL_64K, host={"capacity": 64 * LAYOUT_64K.bytes_per_block})
        d = start_daemon(config)
        tier = connect()
        keys = keys_for(24, seed=82)
        assert tier.put(keys, [noise_for(k) for k in keys]) == [True] * len(keys)
        tier.flush()
        tier.close()
        assert d.stop() == 0
        assert flip_big_node_size(root / "lmdb" / "data.mdb", keys[-1], 23) >= 1  # 65,584 -> 8,454,192 bytes

        d = start_daemon(config)
        tier = connect()
        dests = [torch.empty(LAYOUT_64K.bytes_per_block, dtype=torch.uint8) for _ in keys]
        found = tier.get(keys, dests)
        assert found == [True] * (len(keys) - 1) + [False]
        assert all(bool((b == noise_for(k)).all()) for k, b, ok in zip(keys, dests, found) if ok)
        assert d.proc.poll() is None  # alive: the value was never touched
        other = connect()  # every client is served as before; the damaged block is gone, not refetched
        assert other.get(keys, [torch.empty_like(b) for b in dests]) == found
        other.close()
        tier.close()
        assert d.stop() == 0
        log = d.log.read_text()
        assert f"{root / 'lmdb'}/data.mdb whose LMDB node is damaged" in log and "out of bounds" in log
        assert "kvstore repair" in log
    finally:
        cleanup(d, root)


def test_pages_zeroed_while_the_daemon_runs_are_misses_and_failed_writes_never_a_signal() -> None:
    """Damage after the start-time walk: LMDB meets it on a key's search path (an error, not an abort), so
    gets are misses, puts and flushes that need those pages fail with a message, and the daemon serves on."""
    from kvstore.errors import NotDurable

    root = short_tmpdir()
    d = None
    try:
        config = write_config(root)
        d = start_daemon(config)
        tier = d.tier()
        keys = put_flushed(tier, 400, seed=83)
        data = bytearray((root / "lmdb" / "data.mdb").read_bytes())
        tree = [p for p in range(2, len(data) // 4096)  # live leaf and branch pages (their own number inside)
                if struct.unpack_from("<H", data, p * 4096 + 10)[0] in (1, 2) and struct.unpack_from("<Q", data, p * 4096)[0] == p]
        with open(root / "lmdb" / "data.mdb", "r+b") as f:  # LMDB maps the file shared: it sees this at once
            for p in tree[len(tree) // 3 :: 3]:
                f.seek(p * 4096)
                f.write(bytes(4096))
        dests = empty_blocks(len(keys))
        found = tier.get(keys, dests)
        assert all(bool((b == block_for(k)).all()) for k, b, ok in zip(keys, dests, found) if ok)
        more = keys_for(100, seed=84)
        for i in range(0, len(more), 20):
            tier.put(more[i : i + 20], [block_for(k) for k in more[i : i + 20]])  # accepted into RAM either way
        try:
            tier.flush()
        except NotDurable:
            pass  # the disk write failed on a damaged page: said so, nothing acknowledged falsely
        assert d.proc.poll() is None, d.log.read_text()[-3000:]
        other = d.tier()
        dests = empty_blocks(len(more))
        got = other.get(more, dests)
        assert all(bool((b == block_for(k)).all()) for k, b, ok in zip(more, dests, got) if ok) and any(got)
        for client in (other, tier):
            try:
                client.close()  # its flush reports what the damaged disk did not take
            except NotDurable as exc:
                assert "data.mdb is damaged" in str(exc) and "kvstore repair" in str(exc)
        assert d.proc.poll() is None
        d.stop()
        log = d.log.read_text()
        assert "Traceback" not in log and "kvstore repair" in log
    finally:
        cleanup(d, root)
