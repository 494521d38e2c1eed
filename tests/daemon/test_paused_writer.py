"""A writer paused between reserving host slots and copying into them (a GC pause, swap, a stopped container).

Its reservations expire after ``daemon.hold_timeout_s``; the daemon must not hand those slots to other
blocks while the writer's process may still copy into them (it maps the shared segment: closing or
expiring its connection cannot stop a late memcpy). The late copy then lands in slots nobody else uses,
the writer's commit is refused, and every other client's block keeps its bytes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from daemonlib import block_for, cleanup, empty_blocks, keys_for, short_tmpdir, start_daemon, write_config

PAUSE_S = 3.5  # past the 2 s hold timeout write_config gives the daemon


def test_a_paused_writers_late_copy_never_lands_in_another_blocks_slot() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root))
        writer, other, reader = d.tier(client_name="paused"), d.tier(client_name="other"), d.tier(client_name="reader")
        mine, theirs = keys_for(16, seed=61), keys_for(16, seed=62)
        copy = writer._copy

        def paused_copy(*args: Any) -> None:  # the pause falls after the freshness check, before the memcpy
            time.sleep(PAUSE_S)
            copy(*args)

        writer._copy = paused_copy  # type: ignore[method-assign]
        result: list[list[bool]] = []
        t = threading.Thread(target=lambda: result.append(writer.put(mine, [block_for(k) for k in mine])))
        t.start()
        time.sleep(2.7)  # the writer's reservations have expired and been reaped; it is still paused
        assert other.put(theirs, [block_for(k) for k in theirs]) == [True] * 16
        t.join()
        assert result == [[False] * 16]  # the late commit is refused
        for _ in range(2):  # now and after the writer's slots are free again
            dests = empty_blocks(16)
            assert reader.get(theirs, dests) == [True] * 16
            wrong = [k[:4].hex() for k, b in zip(theirs, dests) if not bool((b == block_for(k)).all())]
            assert not wrong, f"blocks served with the paused writer's bytes: {wrong}"
            writer._copy = copy  # type: ignore[method-assign]
            assert writer.put(mine, [block_for(k) for k in mine]) == [True] * 16  # the writer, on time, stores
        for t_ in (writer, other, reader):
            t_.close()
    finally:
        cleanup(d, root)
