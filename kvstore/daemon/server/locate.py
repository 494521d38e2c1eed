"""Where the leading blocks of a key sequence are on this daemon: runs of host and disk blocks.

A pure function of the two tiers' membership (it changes nothing), kept apart from the backend that counts
and extends its answers (the prefix-cache counters, the remote tier's groups after the local prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.daemon.wire.messages import Runs
from kvstore.tiers.base import Tier


def local_prefix(host: Tier, disk: Tier | None, keys: Sequence[bytes]) -> Runs:
    """The leading blocks of ``keys`` that ``host`` or ``disk`` holds, as runs by the faster tier holding each
    (the disk keeps a copy of most host blocks: a block in both is a host block). Changes nothing.

    Each step asks one tier for a prefix, so a long run costs one call, not one per key::

        keys     k0 k1 k2 k3 k4 k5
        host      x  x        x
        disk      x  x  x  x  x
        runs     (host, 2) (disk, 2) (host, 1)   k5: in neither, the prefix ends
    """
    runs: list[tuple[str, int]] = []
    i, n, on_disk = 0, len(keys), 0  # keys[i:on_disk] are known to be on disk
    while i < n:
        step = host.contains_prefix(keys[i:])
        if step:
            runs.append(("host", step))
            i += step
            continue
        if on_disk <= i:
            step = disk.contains_prefix(keys[i:]) if disk is not None else 0
            if step == 0:
                break
            on_disk = i + step
        j = i + 1  # keys[i] is on disk only; so are the keys after it up to the next one host holds
        while j < on_disk and not host.contains(keys[j]):
            j += 1
        runs.append(("disk", j - i))
        i = j
    return tuple(runs)
