"""Zeroed LMDB pages never take the daemon down at start.

LMDB meets a page that is neither a leaf nor a branch with ``abort()`` inside
``mdb_cursor_next`` (``Assertion 'IS_LEAF(mp)'``), which the daemon's start
hits while it reads its access records. The daemon walks its databases in a
child first and refuses to start, naming ``data.mdb`` and ``kvstore repair``;
the salvage then keeps every block that still verifies and the daemon starts.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

from daemonlib import REPO, block_for, cleanup, empty_blocks, keys_for, short_tmpdir, start_daemon, write_config


def zero_access_record_pages(data_file: Path, keys: list[bytes], page_size: int = 4096) -> int:
    """Zero every ``lru`` leaf page (16-byte values) of ``data_file`` but those holding the smallest key.

    The first leaf in key order stays intact, so a cursor walk starts and then steps onto a zeroed page
    (neither leaf nor branch): LMDB's ``IS_LEAF`` assertion. Stale copies (copy-on-write leftovers) are
    zeroed too, which changes nothing LMDB reads. Returns how many pages were zeroed."""
    data = bytearray(data_file.read_bytes())
    first = min(keys)
    zeroed = 0
    for start in range(0, len(data) - page_size + 1, page_size):
        page = data[start : start + page_size]
        if first in page or not struct.unpack_from("<H", page, 10)[0] & 0x02:  # P_LEAF pages only
            continue
        for key in keys:
            at = page.find(key)
            if at >= 24:
                lo, hi, flags = struct.unpack_from("<HHH", page, at - 8)
                if (lo | hi << 16) == 16 and not flags & 1:
                    data[start : start + page_size] = bytes(page_size)
                    zeroed += 1
                break
    data_file.write_bytes(bytes(data))
    return zeroed


def test_zeroed_pages_refuse_the_start_with_a_message_and_salvage_recovers() -> None:
    root = short_tmpdir()
    d = None
    try:
        config = write_config(root, host={"capacity": 512 * 64})
        d = start_daemon(config)
        tier = d.tier()
        keys = keys_for(400, seed=81)
        for i in range(0, len(keys), 50):
            assert tier.put(keys[i : i + 50], [block_for(k) for k in keys[i : i + 50]]) == [True] * 50
        tier.flush()
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
