"""Replay a trace through kvstore's cache policy: radix-tree LRU on the GPU, host and disk tiers below.

The model follows the store's request flow (``write_back``):

1. ``RadixIndex.match_keys`` finds the GPU-resident prefix (the index here
   holds exactly the GPU blocks);
2. lookup continues down the hash chain in the host tier, then the disk
   tier (the store's batched ``contains_prefix`` probe); those hits are
   promoted: a disk hit is copied into host (inclusive tiers) and every hit
   is loaded into GPU blocks; with ``exclusive`` (host and disk hold distinct blocks)
   a disk hit is not copied into host, the host hits stay pinned while GPU
   room is made, and every host hit that got a GPU block then leaves host (a disk
   copy stays: it may have been acknowledged as durable);
3. the request's path is locked, room is made on the GPU by evicting the
   least recently used unlocked radix leaf (a whole node, as SGLang does),
   and the prompt's full blocks are inserted;
4. an evicted GPU block is written to host unless host (or, exclusive, disk) already has it; a
   host eviction spills to disk unless disk already has it; a disk eviction
   deletes the block.

With ``carry_uses`` (a placement policy's ``carry_uses``) a block's use count (its insert
plus every request that matched it, the store's ``BlockEntry.hits + 1``) is
kept while the block is in any tier and seeds the order of a tier it
enters (:meth:`~kvstore.policy.order.EvictionOrder.seed`: GDSF starts it
at that count). The store drops an orphan (a lower-tier block whose prefix
left every tier) and its count; the simulator keeps both, as it keeps the
orphan itself. With ``use_memory`` (a placement policy's ``use_memory``) the count of a
block dropped from every tier goes to a :class:`~kvstore.policy.use_memory.UseMemory`
of ``use_memory x (host + disk)`` blocks, the store's class, and a block
indexed again resumes it.

With no host and no disk this is "GPU-only LRU" (SGLang's radix cache).
The host and disk tiers evict through the real tiers' order classes
(:mod:`kvstore.policy.order`), so a policy is simulated by the code that
runs it: :meth:`TieredCacheSim.for_policy` builds a named placement policy's
orders and switches as the store does; the constructor's parameters
(``host_policy``, ``disk_policy``, ``duel_scope``, ``gdsf_weight``, ...)
replay variants no named policy stands for. :mod:`kvstore.bench.store_replay`
replays a sample through the store itself to check the model against it.

The index chooses no victims itself; replaying 12k requests needs millions
of whole-leaf evictions, so :class:`_LeafHeap` keeps SGLang's order (least
recent ``last_access`` first) in a lazy heap: an entry
is stale once its node was touched again, removed, or gained a child.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection
from dataclasses import dataclass

from kvstore.bench.workloads import Request
from kvstore.layout import KVLayout
from kvstore.store.radix import RadixIndex, RadixNode
from kvstore.policy.duel import shared_duel
from kvstore.policy.order import EvictionOrder, make_order
from kvstore.policy.gdsf import LINEAR, WEIGHTS, CountWeight
from kvstore.policy.named import PlacementPolicy
from kvstore.policy.use_memory import UseMemory

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
            if node.pin_count:
                locked.append(item)
                continue
            found = node
            break
        for item in locked:
            heapq.heappush(self._heap, item)
        return found


class SimTier:
    """A lower tier counted in blocks, evicting through the same order class as the real tier.

    The order is :func:`~kvstore.policy.order.make_order`'s (``LRUIndex`` or ``S3FIFOIndex``), each
    block accounted as 1 unit against a budget of ``capacity`` units, with the call sequence of
    ``DiskTier.put``: ``victims`` for the incoming block, ``remove`` each, then ``add``.
    """

    def __init__(self, capacity: int, order: str | EvictionOrder = "lru", weight: CountWeight = LINEAR) -> None:
        """``order``: a policy name for :func:`make_order` (built with GDSF's count ``weight``), or an order
        object (for variants YAML cannot name)."""
        self.capacity = capacity
        self.order: EvictionOrder = make_order(order, weight) if isinstance(order, str) else order

    def __contains__(self, block: bytes) -> bool:
        return block in self.order

    def touch(self, block: bytes) -> None:
        """A hit (LRU: most recent; S3-FIFO: frequency + 1)."""
        self.order.touch(block)

    def add(self, block: bytes, pinned: Collection[bytes] = ()) -> list[bytes]:
        """Store ``block``; returns the blocks evicted for it (``[block]`` itself when the tier has no room).
        ``pinned`` blocks are never victims (as the host tier skips pinned slots); if only they are left, the
        tier has no room."""
        if self.capacity <= 0:
            return [block]
        evicted = self.order.victims(1, self.capacity, exclude=pinned)
        if self.order.used - len(evicted) + 1 > self.capacity:
            return [block]  # full of pinned blocks: the store sends a GPU victim straight to disk then
        for victim in evicted:
            self.order.remove(victim)
        self.order.add(block, 1)
        return evicted


class TieredCacheSim:
    """kvstore's GPU + host + disk caching of a trace, counted in blocks."""

    def __init__(self, gpu_blocks: int, host_blocks: int = 0, disk_blocks: int = 0, *,
                 disk_policy: str | EvictionOrder = "lru", host_policy: str | EvictionOrder = "lru",
                 carry_uses: bool = False, exclusive: bool = False, use_memory: float = 0.0,
                 duel_scope: str = "tier", gdsf_weight: str = "linear") -> None:
        """The parameters of a placement policy (:class:`~kvstore.policy.named.PlacementPolicy`), one by one, so
        the bench can replay variants no named policy stands for (:meth:`for_policy` builds a named one):
        ``disk_policy`` / ``host_policy``: each tier's order (``lru``, ``s3fifo``, ``gdsf``, ``duel`` or an order
        object); ``carry_uses``: seed a tier's order with a block's use count when the block enters it;
        ``exclusive``: a block loaded from host leaves host, one on disk is not copied into host; ``use_memory``: remember the counts of dropped
        blocks, this many x (host + disk) of them (needs ``carry_uses``); ``duel_scope``: ``below_gpu`` makes
        host and disk one shared duel (both policies must be ``duel``); ``gdsf_weight``: the count weight of
        the GDSF orders (``linear`` or ``damped``)."""
        if gpu_blocks <= 0:
            raise ValueError("the GPU tier needs at least one block")
        if use_memory > 0 and not carry_uses:
            raise ValueError("use_memory needs carry_uses")
        self.memory = UseMemory(int(use_memory * (host_blocks + disk_blocks))) if use_memory > 0 else None
        self.index = RadixIndex(_LAYOUT)
        self.free_gpu = list(range(gpu_blocks))
        if gdsf_weight not in WEIGHTS:
            raise ValueError(f"gdsf_weight must be one of {sorted(WEIGHTS)}, got {gdsf_weight!r}")
        weight = WEIGHTS[gdsf_weight]
        if duel_scope == "below_gpu":
            if host_policy != "duel" or disk_policy != "duel":
                raise ValueError("duel_scope below_gpu needs host_policy and disk_policy 'duel'")
            host_policy, disk_policy = shared_duel(2, weight)
        elif duel_scope != "tier":
            raise ValueError(f"duel_scope must be 'tier' or 'below_gpu', got {duel_scope!r}")
        self.host = SimTier(host_blocks, host_policy, weight)
        self.disk = SimTier(disk_blocks, disk_policy, weight)
        self._leaves = _LeafHeap()
        self.carry_uses = carry_uses
        self.uses: dict[bytes, int] = {}
        """Use count of each block in some tier (kept only with ``carry_uses``)."""
        self._held: set[bytes] = set()
        self.exclusive = exclusive
        self._pinned_host: set[bytes] = set()

    @classmethod
    def for_policy(cls, policy: PlacementPolicy, gpu_blocks: int, host_blocks: int, disk_blocks: int,
                   write: str = "write_back") -> TieredCacheSim:
        """The store under the named placement ``policy``: its own orders (:meth:`PlacementPolicy.orders`), counts
        carried and remembered as it says, exclusive tiers where it makes them under ``write`` (the replay
        itself follows ``write_back``'s flow; ``write="write_through"`` stands for a write policy that keeps the
        tiers inclusive)."""
        orders = policy.orders(both_tiers=host_blocks > 0 and disk_blocks > 0)
        return cls(gpu_blocks, host_blocks, disk_blocks, host_policy=orders.host, disk_policy=orders.disk,
                   carry_uses=policy.carry_uses, exclusive=policy.exclusive(write), use_memory=policy.use_memory)

    def request(self, req: Request, keys: list[bytes] | None = None) -> HitCounts:
        """Serve one prompt: count its cached prefix per tier, then cache its full blocks. ``keys``: the blocks'
        keys, when not their ids' bytes (a store's own keys, so the duel's hash sample picks the same blocks)."""
        ids = req.blocks.tolist()
        if keys is None:
            keys = [i.to_bytes(8, "little") for i in ids]
        match = self.index.match_keys(keys)
        g = match.num_blocks
        self._leaves.push(match.node)
        hits: list[tuple[bytes, bool]] = []  # (block, found on host)
        for block in keys[g:]:
            if block in self.host:
                hits.append((block, True))
            elif block in self.disk:
                hits.append((block, False))
            else:
                break
        if self.carry_uses:
            uses = self.uses
            for block in keys[: g + len(hits)]:
                uses[block] += 1
            self._held = {block for block, _ in hits}  # the store's lookup pins their entries until loaded
        h = sum(1 for _, on_host in hits if on_host)
        d = len(hits) - h
        # Deepest block first, as the tiers update their order: a prompt's first blocks end up the most
        # recently used, so a tier evicts the tail of a prefix before its head (which every suffix needs).
        for block, on_host in reversed(hits):
            if on_host:
                self.host.touch(block)
            else:
                self.disk.touch(block)
                if not self.exclusive:
                    self._to_host(block)
        if self.exclusive:  # the lease pins its host sources while GPU room is made
            self._pinned_host = {block for block, on_host in hits if on_host}
        self.index.pin(match.node)
        room = self._make_room(len(ids) - g)
        self.index.unpin(match.node)
        if self.exclusive:  # the loaded blocks leave host (those that found no GPU block stay); disk keeps its copies
            for block, on_host in hits[:room]:
                if on_host:
                    self.host.order.remove(block)
            self._pinned_host = set()
        if room:
            res = self.index.insert(keys[: g + room], gpu_blocks=[None] * g + [self.free_gpu.pop() for _ in range(room)])
            if self.carry_uses:
                memory = self.memory
                for block in keys[g : g + room]:
                    if block not in self.uses:  # a block matched below the GPU already has its count
                        self.uses[block] = 1 + (memory.recall(block) if memory is not None else 0)
            self._leaves.push(res.node)
            self._leaves.push(match.node)
        if self._held:
            held, self._held = self._held, set()
            for block in held:
                self._forget_if_gone(block)
        return HitCounts(g, h, d)

    def _make_room(self, need: int) -> int:
        """Evict LRU leaves until ``need`` GPU blocks are free (or nothing evictable is left); returns the room."""
        while len(self.free_gpu) < need:
            victim = self._leaves.pop_lru()
            if victim is None:
                break
            parent = victim.parent
            self.index.remove_leaf(victim)
            if self.carry_uses:
                self._held.update(e.key for e in victim.entries)  # indexed until their copies are published
            for e in reversed(victim.entries):  # the store spills a node's tail first, too
                assert e.gpu_block is not None
                self.free_gpu.append(e.gpu_block)
                if e.key not in self.host and not (self.exclusive and e.key in self.disk):
                    self._to_host(e.key)
            if parent is not None and parent is not self.index.root:
                self._leaves.push(parent)
        return min(need, len(self.free_gpu))

    def _to_host(self, block: bytes) -> None:
        """Copy ``block`` into host; a host victim is written to disk unless disk has it (then just dropped)."""
        for spilled in self._add(self.host, block):
            if spilled not in self.disk:
                for gone in self._add(self.disk, spilled):
                    self._forget_if_gone(gone)
            self._forget_if_gone(spilled)

    def _add(self, tier: SimTier, block: bytes) -> list[bytes]:
        """``tier.add(block)``, then its count into the tier's order (``carry_uses``); returns the evicted."""
        evicted = tier.add(block, self._pinned_host if tier is self.host else ())
        if self.carry_uses and block in tier:
            tier.order.seed(block, self.uses[block])
        return evicted

    def _forget_if_gone(self, block: bytes) -> None:
        """Drop the use count of a block no tier holds any more (the store drops its index entry)."""
        if (self.carry_uses and block not in self._held and block not in self.host and block not in self.disk
                and self.index.get(block) is None):
            uses = self.uses.pop(block, None)
            if uses is not None and self.memory is not None:
                self.memory.remember(block, uses)


class PooledCacheSim:
    """One flat cache of ``capacity`` blocks with no tiers, under an eviction order: the pooled online cache of
    the same total size as a tiered store's GPU + host + disk, to compare placement against.

    A request finds the longest prefix of its blocks in the cache (each touched, deepest first), then every
    block of it is kept, evicting through ``order`` (blocks of the request itself are never its victims).
    """

    def __init__(self, capacity: int, order: str = "lru") -> None:
        if capacity <= 0:
            raise ValueError("the pooled cache needs at least one block")
        self.tier = SimTier(capacity, order)

    def request(self, req: Request) -> int:
        """Serve one prompt; returns the blocks of its prefix that were cached."""
        keys = [i.to_bytes(8, "little") for i in req.blocks.tolist()]
        hit = 0
        for block in keys:
            if block not in self.tier:
                break
            hit += 1
        for block in reversed(keys[:hit]):
            self.tier.touch(block)
        mine = set(keys)
        for block in reversed(keys[hit:]):  # deepest first, so the prompt's head ends up the most recent
            if block in self.tier:  # kept past a gap in the prefix: a use, not a new block
                self.tier.touch(block)
            else:
                self.tier.add(block, mine)
        return hit
