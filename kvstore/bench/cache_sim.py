"""Replay a trace through kvstore's cache policy: radix-tree LRU on the GPU, LRU host and disk below.

The model follows the store's request flow (``write_back``):

1. ``RadixIndex.match_keys`` finds the GPU-resident prefix (the index here
   holds exactly the GPU blocks);
2. lookup continues down the hash chain in the host tier, then the disk
   tier (the store's batched ``contains_prefix`` probe); those hits are
   promoted: a disk hit is copied into host (inclusive tiers) and every hit
   is loaded into GPU blocks;
3. the request's path is locked, room is made on the GPU by evicting the
   least recently used unlocked radix leaf (a whole node, as SGLang does),
   and the prompt's full blocks are inserted;
4. an evicted GPU block is written to host unless host already has it; a
   host eviction spills to disk unless disk already has it; a disk eviction
   deletes the block.

With no host and no disk this is "GPU-only LRU" (SGLang's radix cache).

``RadixIndex.evict_lru_leaf`` rescans every node per eviction; replaying
12k requests needs millions of evictions, so :class:`_LeafHeap` keeps the
same order (least recent ``last_access`` first) in a lazy heap: an entry
is stale once its node was touched again, removed, or gained a child.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass

from kvstore.bench.workloads import Request
from kvstore.layout import KVLayout
from kvstore.radix import RadixIndex, RadixNode

_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, model_id="bench-sim")


@dataclass(frozen=True)
class HitCounts:
    """Blocks found per tier for one request."""

    gpu: int
    host: int
    disk: int

    @property
    def total(self) -> int:
        """Blocks of the prompt that were not recomputed."""
        return self.gpu + self.host + self.disk


class _LeafHeap:
    """Radix leaves ordered by last access, with lazy deletion."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._seq = itertools.count()

    def push(self, node: RadixNode) -> None:
        """Offer ``node`` for eviction at its current access time (ignored unless it is a leaf)."""
        if node.is_leaf and node.entries:
            heapq.heappush(self._heap, (node.last_access, next(self._seq), node))

    def pop_lru(self) -> RadixNode | None:
        """The least recently used unlocked leaf still in the tree, removed from the heap; ``None`` if none."""
        locked: list[tuple[int, int, RadixNode]] = []
        found = None
        while self._heap:
            item = heapq.heappop(self._heap)
            access, _, node = item
            if node.parent is None or not node.is_leaf or access != node.last_access:
                continue
            if node.lock_ref:
                locked.append(item)
                continue
            found = node
            break
        for item in locked:
            heapq.heappush(self._heap, item)
        return found


class _LRUTier:
    """A block-count LRU (an ``OrderedDict``: move-to-end on touch, pop-first on evict)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def touch(self, block: int) -> None:
        self.blocks.move_to_end(block)

    def add(self, block: int) -> int | None:
        """Insert ``block`` as most recent; returns the evicted block, if one had to go."""
        if self.capacity <= 0:
            return block
        self.blocks[block] = None
        if len(self.blocks) > self.capacity:
            return self.blocks.popitem(last=False)[0]
        return None


class TieredCacheSim:
    """kvstore's GPU + host + disk caching of a trace, counted in blocks."""

    def __init__(self, gpu_blocks: int, host_blocks: int = 0, disk_blocks: int = 0) -> None:
        if gpu_blocks <= 0:
            raise ValueError("the GPU tier needs at least one block")
        self.index = RadixIndex(_LAYOUT)
        self.free_gpu = list(range(gpu_blocks))
        self.host = _LRUTier(host_blocks)
        self.disk = _LRUTier(disk_blocks)
        self._leaves = _LeafHeap()

    def request(self, req: Request) -> HitCounts:
        """Serve one prompt: count its cached prefix per tier, then cache its full blocks."""
        ids = req.blocks.tolist()
        keys = [i.to_bytes(8, "little") for i in ids]
        match = self.index.match_keys(keys)
        g = match.num_blocks
        self._leaves.push(match.node)
        h = d = 0
        for block in ids[g:]:
            if block in self.host:
                self.host.touch(block)
                h += 1
            elif block in self.disk:
                self.disk.touch(block)
                self._to_host(block)
                d += 1
            else:
                break
        self.index.lock(match.node)
        room = self._make_room(len(ids) - g)
        self.index.unlock(match.node)
        if room:
            res = self.index.insert(keys[: g + room], gpu_blocks=[None] * g + [self.free_gpu.pop() for _ in range(room)])
            self._leaves.push(res.node)
            self._leaves.push(match.node)
        return HitCounts(g, h, d)

    def _make_room(self, need: int) -> int:
        """Evict LRU leaves until ``need`` GPU blocks are free (or nothing evictable is left); returns the room."""
        while len(self.free_gpu) < need:
            victim = self._leaves.pop_lru()
            if victim is None:
                break
            parent = victim.parent
            self.index.remove_leaf(victim)
            for e in victim.entries:
                assert e.gpu_block is not None
                self.free_gpu.append(e.gpu_block)
                block = int.from_bytes(e.key, "little")
                if block not in self.host:
                    self._to_host(block)
            if parent is not None and parent is not self.index.root:
                self._leaves.push(parent)
        return min(need, len(self.free_gpu))

    def _to_host(self, block: int) -> None:
        spilled = self.host.add(block)
        if spilled is not None and spilled not in self.disk:
            self.disk.add(spilled)
