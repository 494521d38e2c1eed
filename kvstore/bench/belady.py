"""Belady's offline optimum (MIN with bypass) for a prefix cache of a fixed number of blocks.

Variant: block-level furthest-next-use eviction over the *total* capacity
(GPU + host + disk as one pool), hits counted as the longest prefix of a
prompt's blocks that are all cached (a block without its parent is useless
to a prefix cache). It stays prefix-closed without enforcing it: every
request that uses a block also uses its parent, so a parent's next use is
never later than its child's, and ties are broken by evicting the deeper
block first. After each request all its blocks are admitted and the
furthest-next-use blocks are evicted until the pool fits, which may evict a
just-admitted block (bypass, the optimal choice when it is needed last).

Cost: next uses are precomputed in one backward pass; eviction is a max-heap
keyed by (next use, depth) with lazy deletion, so the replay is
O(total blocks x log).
"""

from __future__ import annotations

import heapq
import itertools

from kvstore.bench.workloads import Request

NEVER = 1 << 62
"""Next use of a block that is never requested again."""


def next_uses(requests: list[Request]) -> list[list[int]]:
    """``out[r][j]``: index of the next request after ``r`` that uses block ``j`` of request ``r`` (or NEVER)."""
    upcoming: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for r in range(len(requests) - 1, -1, -1):
        ids = requests[r].blocks.tolist()
        out[r] = [upcoming.get(b, NEVER) for b in ids]
        for b in ids:
            upcoming[b] = r
    return out


def belady_hits(requests: list[Request], capacity_blocks: int) -> list[int]:
    """Cached prefix blocks of each request under the offline optimum with ``capacity_blocks``."""
    nxt = next_uses(requests)
    cached: dict[int, int] = {}  # block -> its next use while cached
    heap: list[tuple[int, int, int, int]] = []  # (-next use, -depth, tiebreak, block)
    seq = itertools.count()
    hits: list[int] = []
    for r, req in enumerate(requests):
        ids = req.blocks.tolist()
        h = 0
        while h < len(ids) and ids[h] in cached:
            h += 1
        hits.append(h)
        for depth, (b, n) in enumerate(zip(ids, nxt[r])):
            cached[b] = n
            heapq.heappush(heap, (-n, -depth, next(seq), b))
        while len(cached) > capacity_blocks:
            neg_n, _, _, b = heapq.heappop(heap)
            if cached.get(b) == -neg_n:
                del cached[b]
    return hits
