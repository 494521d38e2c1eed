"""The tiered store: GPU block pool + radix index + host and disk tiers, behind one small API.

Request flow (see ``DESIGN.md``)::

    tokens ─► block keys ─► radix match ─► probe lower tiers ─► PrefixMatch
    acquire(match) ─► Lease (GPU hits referenced, lower-tier hits loading)
    engine computes the suffix ─► commit(keys, blocks) ─► release(lease)

Every method says what it changes. One lock serialises the index and the
pool; disk I/O and copies happen on worker threads outside it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.config.schema import KVStoreConfig, PolicyConfig
from kvstore.errors import BlockStateError, OutOfBlocks
from kvstore.events import StoreEvent
from kvstore.gpu_pool import GPUBlockPool
from kvstore.hashing import Salt, block_keys
from kvstore.hierarchy import Hierarchy
from kvstore.layout import KVLayout
from kvstore.prefetch import BlockPlan, Lease, Prefetcher
from kvstore.spill import Spiller
from kvstore.tiers.base import Tier

log = logging.getLogger("kvstore.store")


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a prompt and where its blocks are (fastest copy)."""

    keys: tuple[bytes, ...]
    """Keys of the matched blocks, in order."""
    tiers: tuple[str, ...]
    """``"gpu"``, ``"host"`` or ``"disk"`` per matched block."""
    block_size: int
    prompt_tokens: int
    tokens: Sequence[int] | None = None
    """The matched tokens (``num_blocks * block_size``), when the lookup had tokens."""
    salt: Salt = None
    """The tenant salt the keys were made with."""

    @property
    def num_blocks(self) -> int:
        """Matched full blocks."""
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        """Matched tokens."""
        return len(self.keys) * self.block_size

    def tokens_in(self, tier: str) -> int:
        """Matched tokens whose fastest copy is in ``tier``."""
        return self.tiers.count(tier) * self.block_size


class TieredStore:
    """The store. Build it with :meth:`from_config` or from parts."""

    def __init__(
        self,
        layout: KVLayout,
        pool: GPUBlockPool,
        host: Tier | None = None,
        disk: Tier | None = None,
        policy: PolicyConfig | None = None,
    ) -> None:
        self.policy = policy or PolicyConfig()
        self.h = Hierarchy(layout, pool, host, disk)
        self.spiller = Spiller(self.h, self.policy)
        self.prefetcher = Prefetcher(self.h, self.policy)
        self.layout = layout

    @classmethod
    def from_config(cls, cfg: KVStoreConfig, pool: GPUBlockPool | None = None) -> TieredStore:
        """Build the pool (unless given; a given pool's layout wins over ``cfg.model``) and the configured tiers."""
        from kvstore.tiers.build import build_lower_tiers

        layout = pool.layout if pool is not None else cfg.model.layout()
        if pool is None:
            device = None if cfg.gpu.device == "auto" else cfg.gpu.device
            pool = GPUBlockPool(layout, cfg.gpu.num_blocks, device=device)
        host, disk = build_lower_tiers(cfg, layout)
        log.info(
            "tiered store: gpu %d blocks on %s, host %s, disk %s, write %s, prefetch %s",
            pool.num_blocks, pool.device, host.name if host else "off", disk.name if disk else "off",
            cfg.policy.write, cfg.policy.prefetch,
        )
        return cls(layout, pool, host, disk, cfg.policy)

    # ------------------------------------------------------------ accessors
    @property
    def pool(self) -> GPUBlockPool:
        """The GPU block pool."""
        return self.h.pool

    @property
    def index(self):  # noqa: ANN201 - RadixIndex
        """The radix index (read it under :attr:`lock`)."""
        return self.h.index

    @property
    def lock(self):  # noqa: ANN201 - threading.RLock
        """The lock serialising index and pool changes."""
        return self.h.lock

    def keys(self, tokens: Sequence[int], salt: Salt = None) -> list[bytes]:
        """Block keys of ``tokens`` for this store's layout."""
        return block_keys(tokens, self.layout, salt)

    # --------------------------------------------------------------- lookup
    def lookup(self, tokens: Sequence[int], salt: Salt = None) -> PrefixMatch:
        """Longest prefix of ``tokens`` cached in any tier. Changes access order and hit counts only.

        The index is walked by token comparison (no hashing); keys are computed
        only for the blocks beyond the index match, to probe the lower tiers
        (which may hold blocks another process or an earlier run wrote).
        """
        toks = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)  # type: ignore[union-attr]
        bs = self.layout.block_size
        n_full = len(toks) // bs
        h = self.h
        h.sync_tier_events()
        selective = self.policy.write == "write_through_selective"
        with h.lock:
            m = h.index.match(toks, salt, count_hits=selective)
            if m.num_blocks < n_full:
                first = m.entries[-1].key if m.entries else h.index.root_key(salt)
                rest = block_keys(toks[m.num_blocks * bs : n_full * bs], self.layout, parent=first)
                if h.index.get(rest[0]) is not None:  # blocks indexed by key only continue the match
                    m = h.index.match_keys([e.key for e in m.entries] + rest, count_hits=False)
                    rest = rest[m.num_blocks - (n_full - len(rest)) :]
            else:
                rest = []
            keys = [e.key for e in m.entries]
            tiers = [e.tier or "disk" for e in m.entries]
            if selective:
                self.spiller.on_hit(m.entries)
        return self._probe_and_count(keys, tiers, rest, len(toks), toks, salt)

    def lookup_keys(self, keys: Sequence[bytes], prompt_tokens: int | None = None) -> PrefixMatch:
        """:meth:`lookup` for a precomputed key chain (dictionary lookups in the index, then the probe)."""
        h = self.h
        h.sync_tier_events()
        selective = self.policy.write == "write_through_selective"
        with h.lock:
            m = h.index.match_keys(keys, count_hits=selective)
            tiers = [e.tier or "disk" for e in m.entries]
            if selective:
                self.spiller.on_hit(m.entries)
        bs = self.layout.block_size
        total = prompt_tokens if prompt_tokens is not None else len(keys) * bs
        return self._probe_and_count([e.key for e in m.entries], tiers, list(keys[m.num_blocks :]), total, None, None)

    def _probe_and_count(self, keys: list[bytes], tiers: list[str], rest: list[bytes], prompt_tokens: int,
                         tokens: list[int] | None, salt: Salt) -> PrefixMatch:
        """Continue a match into the lower tiers with the next keys of the chain, and count the lookup."""
        h = self.h
        for name, tier in h.lower_tiers():
            if not rest:
                break
            n = tier.contains_prefix(rest)
            keys.extend(rest[:n])
            tiers.extend([name] * n)
            rest = rest[n:]
        bs = self.layout.block_size
        matched_tokens = tokens[: len(keys) * bs] if tokens is not None else None
        match = PrefixMatch(tuple(keys), tuple(tiers), bs, prompt_tokens, matched_tokens, salt)
        with h.lock:
            c = h.counters
            c.lookups += 1
            c.prompt_tokens += prompt_tokens
            for t in ("gpu", "host", "disk"):
                c.hit_tokens[t] += match.tokens_in(t)
        return match

    # -------------------------------------------------------------- acquire
    def acquire(self, match: PrefixMatch) -> Lease:
        """Hold the matched prefix for a request and start loading its lower-tier blocks.

        Locks the matched index path, takes a GPU reference on every GPU hit,
        allocates GPU blocks for the rest (evicting unused cached blocks if
        needed), locks or reserves host slots and starts phase 1 of the load.
        When the GPU pool or the host tier cannot take every block, the lease
        covers fewer and :attr:`Lease.shortfall` says why; it never blocks.
        """
        h = self.h
        bs = self.layout.block_size
        shortfall: str | None = None
        with h.lock:
            m = h.index.match_keys(match.keys, count_hits=False)
            h.index.lock(m.node)
            # Pin every source first (index path locked, host slots locked) so that making
            # room on the GPU below cannot evict a block this lease is about to read.
            sources: list[tuple[bytes, str, int | None]] = []  # key, tier, GPU block or host slot
            for e in m.entries:
                if e.tier == "host":
                    assert h.host is not None
                    sources.append((e.key, "host", h.host.lock([e.key])[0]))
                else:
                    sources.append((e.key, e.tier or "disk", e.gpu_block))
            for key in match.keys[len(sources) :]:
                src = self._probe_one(key)
                if src is None:
                    shortfall = "part of the matched prefix left the lower tiers before acquire"
                    break
                sources.append(src)
            need = sum(1 for _, t, _ in sources if t != "gpu")
            if need:
                self.spiller.ensure_gpu_free(need)
            plan: list[BlockPlan] = []
            for i, (key, tier, where) in enumerate(sources):
                p = self._plan_block(key, tier, where)
                if isinstance(p, str):
                    shortfall = p
                    for k, t, _ in sources[i:]:
                        if t == "host":
                            h.host.unlock([k])  # type: ignore[union-attr]
                    break
                plan.append(p)
        tokens = list(match.tokens[: len(plan) * bs]) if match.tokens is not None else None
        lease = Lease(tuple(p.key for p in plan), plan, m.node, bs, self.layout.num_layers, shortfall=shortfall,
                      tokens=tokens, salt=match.salt)
        if shortfall:
            log.info("acquire: %d of %d matched blocks planned: %s", len(plan), match.num_blocks, shortfall)
        self.prefetcher.start(lease)
        return lease

    def _probe_one(self, key: bytes) -> tuple[bytes, str, int | None] | None:
        h = self.h
        if h.host is not None:
            slot = h.host.lock([key])[0]
            if slot is not None and h.host.contains(key):
                return (key, "host", slot)
            if slot is not None:  # reserved by a load in flight, not readable yet
                h.host.unlock([key])
        if h.disk is not None and h.disk.contains(key):
            return (key, "disk", None)
        return None

    def _plan_block(self, key: bytes, tier: str, where: int | None) -> BlockPlan | str:
        """Reserve what one block of a lease needs (called under the lock); a string says why not.

        On failure nothing is taken for this block (the caller unlocks its pinned host slot).
        """
        h = self.h
        if tier == "gpu":
            assert where is not None
            h.pool.incref([where])
            return BlockPlan(key, "gpu", where, ready=True)
        got = h.pool.try_allocate(1)
        if got is None:
            return "GPU pool full: no free block to load into"
        gpu = got[0]
        if tier == "host":  # the slot was locked when the sources were pinned
            return BlockPlan(key, "host", gpu, host_slot=where, ready=True)
        slot = None
        if h.host is not None:
            if h.host.contains(key):  # promoted meanwhile
                return BlockPlan(key, "host", gpu, host_slot=h.host.lock([key])[0], ready=True)
            try:
                slot = self.spiller.host_slot_for(key)
            except BlockStateError:
                slot = None  # another lease is loading the same block into the host tier: stage privately
            else:
                if slot is None:
                    h.pool.free([gpu])
                    return "host tier full of locked blocks: loaded fewer blocks"
        return BlockPlan(key, "disk", gpu, host_slot=slot)

    # --------------------------------------------------------------- release
    def release(self, lease: Lease) -> None:
        """End a lease: cancel unfinished loads, drop its GPU references and unlock its index path."""
        if lease.released:
            return
        lease.resolve()
        for fut in (lease._phase1, lease._phase2):
            if fut is not None:
                fut.result()  # reads and copies into the lease's buffers are over
        h = self.h
        with h.lock:
            h.pool.free([p.gpu_block for p in lease.plan])
            if h.host is not None:
                for p in lease.plan:
                    if p.host_slot is not None:
                        h.host.unlock([p.key])
            if lease.node is not None:
                h.index.unlock(lease.node)
            lease.released = True
            h.reap()

    # ------------------------------------------------------ blocks and commit
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` GPU blocks for new tokens, evicting unused cached blocks first if needed.

        Blocks still being copied down by the write policy hold a reference;
        when only they stand in the way, this waits for those copies. Raises
        :class:`OutOfBlocks` (nothing taken) when even that is not enough.
        """
        for attempt in range(2):
            with self.h.lock:
                if self.h.pool.num_free < n:
                    self.spiller.ensure_gpu_free(n)
                if self.h.pool.num_free >= n:
                    return self.h.pool.allocate(n)
                free = self.h.pool.num_free
            if attempt == 0 and self.spiller.pending():
                self.spiller.wait()  # outside the lock: the copies need it to finish
        raise OutOfBlocks(n, free)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop the caller's reference on each block (cached ones stay in the index)."""
        with self.h.lock:
            self.h.pool.free(block_ids)

    def commit(self, keys: Sequence[bytes], block_ids: Sequence[int], tokens: Sequence[int] | None = None,
               salt: Salt = None) -> int:
        """Record full blocks (``keys[i]`` is in GPU block ``block_ids[i]``) in the index.

        ``tokens`` (the blocks' tokens; ``keys`` must be their chain under
        ``salt``) let later lookups find the blocks without hashing; without
        them the blocks are found by key only. The index takes its own
        reference on each block it records; the caller keeps its own. Keys
        already cached keep their copy (the caller's duplicate block is simply
        not recorded). Applies the write policy. Returns how many blocks were new.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"commit: {len(keys)} keys but {len(block_ids)} blocks")
        h = self.h
        with h.lock:
            res = h.index.insert(keys, gpu_blocks=block_ids, tokens=tokens, salt=salt)
            for i, entry in enumerate(res.entries):
                b = block_ids[i]
                if i >= res.num_existing:
                    h.pool.incref([b])
                    h.events.put("stored", entry.key, "gpu")
                elif entry.gpu_block is None:
                    h.index.set_gpu(entry, b)
                    h.pool.incref([b])
            new = list(res.entries[res.num_existing :])
        self.spiller.on_commit(new)
        return len(new)

    def offload(self, tier: str) -> int:
        """Move every unused block out of ``tier`` (``"gpu"`` or ``"host"``) into the next tier down.

        For draining before a shutdown, and for tests that need a prefix to
        live in a given tier. Blocks in use stay. Returns how many moved.
        """
        h = self.h
        self.spiller.wait()
        with h.lock:
            if tier == "gpu":
                before = h.counters.gpu_evictions
                self.spiller.ensure_gpu_free(h.pool.num_blocks)
                return h.counters.gpu_evictions - before
            if tier == "host":
                if h.host is None:
                    return 0
                return self.spiller.make_host_room(h.host.num_slots)  # type: ignore[attr-defined]
        raise ValueError(f"offload: tier must be 'gpu' or 'host', got {tier!r}")

    def save(self, keys: Sequence[bytes]) -> int:
        """Copy these indexed blocks to every lower tier now and wait; returns how many reached the host tier.

        Used to swap a preempted sequence out instead of recomputing it.
        """
        with self.h.lock:
            entries = [e for e in (self.h.index.get(k) for k in keys) if e is not None]
        self.spiller.write_down(entries)
        self.spiller.wait()
        with self.h.lock:
            return sum(1 for e in entries if e.host_slot is not None)

    # ------------------------------------------------------ stats and upkeep
    def stats(self) -> dict[str, Any]:
        """Per-tier counters and occupancy (a snapshot; changes nothing)."""
        h = self.h
        h.sync_tier_events()
        with h.lock:
            c = h.counters
            out: dict[str, Any] = {
                "lookups": c.lookups,
                "prompt_tokens": c.prompt_tokens,
                "gpu": {
                    "hit_tokens": c.hit_tokens["gpu"],
                    "used_blocks": h.pool.num_used,
                    "capacity_blocks": h.pool.num_blocks,
                    "cached_blocks": sum(1 for n in h.index.nodes() for e in n.entries if e.gpu_block is not None),
                    "evictions": c.gpu_evictions,
                },
                "miss_tokens": c.prompt_tokens - sum(c.hit_tokens.values()),
                "index_blocks": len(h.index),
                "dropped_blocks": c.dropped_blocks,
                "load_failures": c.load_failures,
                "prefetch_backpressure_waits": self.prefetcher.budget.waits,
            }
            for name, tier in h.lower_tiers():
                d: dict[str, Any] = tier.stats().as_dict()
                d["hit_tokens"] = c.hit_tokens[name]
                d["loaded_blocks"] = c.loaded_blocks[name]
                d["spilled_blocks"] = c.spilled_blocks[name]
                out[name] = d
        return out

    def drain_events(self) -> list[StoreEvent]:
        """Return and clear the store's event queue."""
        self.h.sync_tier_events()
        return self.h.events.drain()

    def flush(self) -> None:
        """Wait for scheduled write-downs and make the disk tier durable."""
        self.spiller.wait()
        for _, tier in self.h.lower_tiers():
            tier.flush()

    def close(self) -> None:
        """Flush, stop the workers and close the tiers."""
        self.spiller.close()
        self.prefetcher.close()
        for _, tier in self.h.lower_tiers():
            tier.close()

    def check_integrity(self) -> None:
        """Raise if the index, the pool and the tiers disagree about any block."""
        from kvstore.store_check import check_store

        check_store(self.h)
