"""A shared-memory client's put that finds no host slot the daemon can free is written through to its disk.

Under ``policy.write: write_through`` every committed block stays pinned in the daemon's host tier until its
disk write is done; a disk writer that falls behind (a slow device: here, injected, a writer thread that
stalls) leaves no slot to reserve, and the daemon answers ``NO_ROOM``. The client then sends those blocks
inline, and the daemon writes them straight to its disk tier: the put is slower, not refused (before, the
client retried for a few milliseconds and answered "not stored", so the engine kept no lower copy).
"""

from __future__ import annotations

from daemonlib import LAYOUT, block_for, cleanup, empty_blocks, keys_for, short_tmpdir, start_daemon, write_config

HOST_SLOTS = 8
STALLED_WRITER = """
import os, threading, time
from kvstore.tiers.lmdb.tier import DiskTier
_put = DiskTier.put
def put(self, keys, srcs):
    t0 = time.monotonic()
    while threading.current_thread().name == "kvstore-daemon-writer" and os.path.exists({flag!r}) \\
            and time.monotonic() - t0 < 30:
        time.sleep(0.02)
    return _put(self, keys, srcs)
DiskTier.put = put
"""


def test_a_put_with_every_host_slot_waiting_for_the_disk_is_written_through() -> None:
    root = short_tmpdir()
    flag = root / "stall"
    flag.touch()
    d = None
    try:
        cfg = write_config(root, host={"capacity": HOST_SLOTS * LAYOUT.bytes_per_block},
                           policy={"write": "write_through"})
        d = start_daemon(cfg, before=STALLED_WRITER.format(flag=str(flag)))
        tier = d.tier(client_name="writer")
        assert tier.client.arena is not None  # the shared-memory path, not inline from the start
        first, more = keys_for(HOST_SLOTS, seed=71), keys_for(2 * HOST_SLOTS, seed=72)
        assert tier.put(first, [block_for(k) for k in first]) == [True] * HOST_SLOTS  # pinned: the writer stalls
        assert tier.put(more, [block_for(k) for k in more]) == [True] * (2 * HOST_SLOTS)  # no slot: through to disk
        flag.unlink()
        tier.flush()  # the writer catches up: its slots are free again for the reads from disk
        keys = first + more
        dests = empty_blocks(len(keys))
        assert tier.get(keys, dests) == [True] * len(keys)
        wrong = [k[:4].hex() for k, b in zip(keys, dests) if not bool((b == block_for(k)).all())]
        assert not wrong, f"blocks read back with other bytes: {wrong}"
        tier.close()
    finally:
        flag.unlink(missing_ok=True)
        cleanup(d, root)
