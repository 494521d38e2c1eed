"""The tiered store: GPU block pool + radix index + host, disk and remote tiers, behind one small API.

One file past 500 lines, on purpose: it is the store's API, and each method hands its work to the part that
owns it (:class:`~kvstore.store.placement.Placement`, the spiller, the prefetcher, the remote writer, the
flush); what stays here is the order in which they are called under the one lock (what a lookup, an acquire,
a commit and a release hold and give back), which is read in one place or not at all.

Request flow (see ``DESIGN.md``)::

    tokens ─► block keys ─► radix match ─► probe lower tiers ─► StoreMatch
    acquire(match) ─► StoreLease (GPU hits referenced, lower-tier hits loading)
    engine computes the suffix ─► commit(keys, blocks) ─► release(lease)

Every method says what it changes. One lock serialises the index and the
pool; disk I/O and copies happen on worker threads outside it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from kvstore.config.deadlines import DeadlinesConfig
from kvstore.config.schema import KVStoreConfig, PolicyConfig
from kvstore.config.write_policy import SELECTIVE_HITS_DEFAULT
from kvstore.errors import BlockStateError, OutOfBlocks
from kvstore.events import StoreEvent
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.hashing import Salt, block_keys
from kvstore.store.hierarchy import Hierarchy
from kvstore.layout import KVLayout
from kvstore.store.prefetch import BlockPlan, Prefetcher, StoreLease, first_block_in_window
from kvstore.store.match import StoreMatch
from kvstore.store.radix import BlockEntry, RadixIndex, RadixMatch
from kvstore.lower.remote_write import MAX_QUEUED_BYTES, RemoteWrite
from kvstore.store.remote_writer import RemoteWriter
from kvstore.store.spill import Spiller
from kvstore.store.stats import store_stats
from kvstore.tiers.base import Tier
from kvstore.tiers.chain import ChainTier
from kvstore.tiers.host.tier import HostTier
from kvstore.store.transfer import CopyStreams
from kvstore.policy.named import PlacementPolicy
from kvstore.policy.use_memory import use_memory_for
from kvstore.store.durable import write_all_down

log = logging.getLogger("kvstore.store")

_KEY = attrgetter("key")


class TieredStore:
    """The store. Build it with :meth:`from_config` or from parts.

    ``copy_streams`` issues loads into the pool asynchronously; by default CUDA
    streams for a pool on CUDA and plain copies otherwise (see :class:`Prefetcher`).
    """

    def __init__(
        self,
        layout: KVLayout,
        pool: GPUBlockPool,
        host: HostTier | None = None,
        disk: Tier | None = None,
        policy: PolicyConfig | None = None,
        copy_streams: CopyStreams | None = None,
        remote: ChainTier | None = None,
        remote_write: RemoteWrite = "write_through",
        remote_selective_hits: int = SELECTIVE_HITS_DEFAULT,
        remote_max_queued_bytes: int = MAX_QUEUED_BYTES,
        placement: PlacementPolicy | None = None,
        deadlines: DeadlinesConfig | None = None,
    ) -> None:
        """``placement``: the placement policy itself instead of the one ``policy.placement`` names, for the
        benchmarks and tests that study a variant no name stands for; the host and disk tiers must already
        evict through its orders (:meth:`PlacementPolicy.orders`). ``deadlines``: how long a load may take
        before the engine recomputes instead (``deadlines.load_*``)."""
        self.policy = policy or PolicyConfig()
        if disk is not None and disk.shared and self.policy.write == "write_back":
            # A daemon exists to share: a block reaching it only when it leaves this GPU is one no other engine finds.
            log.info("policy.write: write_back: the %s tier is shared, so blocks are written through to it", disk.name)
            self.policy = self.policy.model_copy(update={"write": "write_through"})
        placement = placement or self.policy.placement_policy()
        self.h = Hierarchy(layout, pool, host, disk, remote, carry_uses=placement.carry_uses,
                           use_memory=use_memory_for(placement.use_memory, layout, host, disk),
                           exclusive=placement.exclusive(self.policy.write))
        self.spiller = Spiller(self.h, self.policy)
        self.remote_writer = (RemoteWriter(self.h, remote, remote_write, remote_selective_hits, remote_max_queued_bytes)
                              if remote is not None else None)
        """Writes full groups to the remote tier under its own write policy (``remote.write``)."""
        if self.remote_writer is not None and remote_write == "write_back":
            self.h.hand_down = self.remote_writer.hand_down
            if disk is not None:  # the disk tier evicts inside its put: it shows the writer its victims first
                if not disk.takes_victim_hook:
                    raise ValueError(f"remote write_back needs a disk tier that shows its victims; {disk.name} does not")
                disk.set_victim_hook(self.remote_writer.disk_victims)
        self.prefetcher = Prefetcher(self.h, self.policy, streams=copy_streams, deadlines=deadlines)
        self.layout = layout

    @classmethod
    def from_config(cls, cfg: KVStoreConfig, pool: GPUBlockPool | None = None) -> TieredStore:
        """Build the pool (unless given; a given pool's layout wins over ``cfg.model``) and the configured tiers.

        Unset data paths get the embedded store's defaults (:meth:`KVStoreConfig.for_role`), never a daemon's.
        """
        from kvstore.lower.build import build_lower_tiers

        cfg = cfg.for_role("embedded")
        layout = pool.layout if pool is not None else cfg.model.layout()
        if pool is None:
            device = None if cfg.gpu.device == "auto" else cfg.gpu.device
            pool = GPUBlockPool(layout, cfg.gpu.num_blocks, device=device)
        tiers = build_lower_tiers(cfg, layout)
        host, disk, remote = tiers.host, tiers.disk, tiers.remote
        log.info(
            "tiered store: gpu %d blocks on %s, host %s, disk %s, remote %s, placement %s, write %s (remote %s), "
            "prefetch %s", pool.num_blocks, pool.device, host.name if host else "off", disk.name if disk else "off",
            remote.name if remote else "off", cfg.policy.placement, cfg.policy.write, cfg.remote.write,
            cfg.policy.prefetch,
        )
        return cls(layout, pool, host, disk, cfg.policy, remote=remote, remote_write=cfg.remote.write,
                   remote_selective_hits=cfg.remote.selective_hits,
                   remote_max_queued_bytes=int(cfg.remote.max_inflight_bytes), deadlines=cfg.deadlines)

    # ------------------------------------------------------------ accessors
    @property
    def pool(self) -> GPUBlockPool:
        """The GPU block pool."""
        return self.h.pool

    @property
    def index(self) -> RadixIndex:
        """The radix index (read it under :attr:`lock`)."""
        return self.h.index

    @property
    def lock(self) -> threading.Lock:
        """The lock serialising index and pool changes (plain, not re-entrant)."""
        return self.h.lock

    def keys(self, tokens: Sequence[int], salt: Salt = None) -> list[bytes]:
        """Block keys of ``tokens`` for this store's layout."""
        return block_keys(tokens, self.layout, salt)

    # --------------------------------------------------------------- lookup
    def lookup(self, tokens: Sequence[int], salt: Salt = None) -> StoreMatch:
        """Longest prefix of ``tokens`` cached in any tier. Changes access order and hit counts only.

        The index is walked by token comparison (no hashing); keys are computed
        only for the blocks beyond the index match, to probe the lower tiers
        (which may hold blocks another process or an earlier run wrote).
        """
        toks = tokens if isinstance(tokens, list) else (tokens.tolist() if hasattr(tokens, "tolist") else list(tokens))
        bs = self.layout.block_size
        n_full = len(toks) // bs
        h = self.h
        h.sync_tier_events()
        count_hits = self.spiller.rule.counts_hits or h.carry_uses
        with h.lock:
            m = h.index.match(toks, salt, count_hits=count_hits)
            if m.num_blocks < n_full:
                first = m.entries[-1].key if m.entries else h.index.root_key(salt)
                # Without a lower tier to probe, only the first key past the match is needed (to see whether
                # blocks indexed by key alone continue it): no hashing of a prompt's uncached tail.
                probe_end = n_full if h.has_lower_tiers else m.num_blocks + 1
                rest = block_keys(toks[m.num_blocks * bs : probe_end * bs], self.layout, parent=first)
                if h.index.get(rest[0]) is not None:  # blocks indexed by key only continue the match
                    if probe_end < n_full:
                        rest = block_keys(toks[m.num_blocks * bs : n_full * bs], self.layout, parent=first)
                    m = h.index.match_keys([e.key for e in m.entries] + rest, count_hits=False)
                    rest = rest[m.num_blocks - (n_full - len(rest)) :]
            else:
                rest = []
            h.placement.touch(m.entries)
            due = self.spiller.due_on_hit(m.entries)
        return self._finish_lookup(m, due, rest, len(toks), toks, salt)

    def _finish_lookup(self, m: RadixMatch, due: list[BlockEntry], rest: list[bytes], prompt_tokens: int,
                       tokens: list[int] | None, salt: Salt) -> StoreMatch:
        """Confirm disk-only blocks with a tier that cannot report evictions, write down ``due``, probe
        beyond the index match ``m`` with ``rest`` (the keys after it), count.

        Called without the lock: the probes are I/O. Builds each per-block sequence once (a 128k-token
        prompt has 8192 blocks: every extra pass shows in the lookup time).
        """
        h = self.h
        entries, tiers = m.entries, m.tiers
        per_tier = {"gpu": m.gpu_blocks, "host": m.host_blocks, "disk": m.disk_blocks, "remote": 0}
        where: list[str] = []
        if not h.disk_reports_evictions:
            n, where = self._confirm_on_disk(entries, tiers)
            if n < len(entries):
                entries, tiers, rest = entries[:n], tiers[:n], []
                per_tier = {t: tiers.count(t) for t in per_tier}
        labels = tiers
        if any(w != "disk" for w in where):  # a daemon: each indexed disk block by the daemon tier holding it
            it = iter(where)
            labels = tuple(next(it) if t == "disk" else t for t in tiers)
            per_tier["disk"] = 0
            for w in where:
                per_tier[w] = per_tier.get(w, 0) + 1
        if due:
            self.spiller.write_down(due)
        keys = tuple(map(_KEY, entries))
        if self.remote_writer is not None:
            self.remote_writer.on_hit(keys)
        for name, tier in h.lower_tiers():
            if not rest:
                break
            if tier.probes_by_chain:  # grouped by chain position (the remote tier, a daemon with one)
                located = tier.locate_chain([*keys, *rest], len(keys))
            else:
                located = tier.locate_prefix(rest)
            k = 0
            for label, n_found in located:  # by the tier behind this one that holds them (a daemon's), or this
                label = label or name
                labels += (label,) * n_found
                per_tier[label] = per_tier.get(label, 0) + n_found
                k += n_found
            keys += tuple(rest[:k])
            tiers += (name,) * k
            rest = rest[k:]
        bs = self.layout.block_size
        matched_tokens = tokens[: len(keys) * bs] if tokens is not None else None
        match = StoreMatch(keys, tiers, labels, bs, prompt_tokens, matched_tokens, salt, entries)
        with h.lock:
            c = h.counters
            c.lookups += 1
            c.prompt_tokens += prompt_tokens
            for t, n_blocks in per_tier.items():
                c.hit_tokens[t] = c.hit_tokens.get(t, 0) + n_blocks * bs
        return match

    def _confirm_on_disk(self, entries: Sequence[BlockEntry], tiers: Sequence[str]) -> tuple[int, list[str]]:
        """Ask the disk tier for the matched blocks only it holds; returns how many leading entries stand, and
        for each disk block among them the name it is reported by (``disk``, or the daemon tier holding it).

        The first block it lacks goes through :meth:`Placement.lost` (as an
        eviction event would), so it is not reported again.
        """
        h = self.h
        assert h.disk is not None
        on_disk = [i for i, t in enumerate(tiers) if t == "disk"]
        if not on_disk:
            return len(entries), []
        where = [label or "disk" for label, n in h.disk.locate_prefix([entries[i].key for i in on_disk])
                 for _ in range(n)]
        if len(where) >= len(on_disk):
            return len(entries), where[: len(on_disk)]
        first_missing = on_disk[len(where)]
        with h.lock:
            h.placement.lost(entries[first_missing].key, "disk")
        return first_missing, where

    # -------------------------------------------------------------- acquire
    def acquire(self, match: StoreMatch, window: int = 0) -> StoreLease:
        """Hold the matched prefix for a request and start loading its lower-tier blocks.

        ``window``: the reader's attention window in tokens when every layer is windowed (Mistral-style; 0: some
        layer reads every key). Host and disk blocks wholly before the first query's window get a GPU block that
        only holds their place and are never read: bytes no layer would look at. (Remote blocks are loaded still:
        the index must hold a copy of every block it chains through.) Should the stop policy later cut the
        prefix so far back that its window reaches such a block, the lease resolves to nothing.

        Pins the matched index path (through the match's entry handles, no
        second walk), takes a GPU reference on every GPU hit and pins host
        sources; then makes GPU room (copies outside the lock), allocates GPU
        blocks for the rest and reserves host slots, and starts phase 1 of
        the load. When the GPU pool or the host tier cannot take every block,
        the lease covers fewer and :attr:`StoreLease.shortfall` says why; it never
        waits for a load.
        """
        h, pl = self.h, self.h.placement
        bs = self.layout.block_size
        shortfall: str | None = None
        with h.lock:
            entries = self._live_prefix(match)
            node = entries[-1].node if entries else None
            if node is not None:
                pl.pin(node)
            # Hold every source first (GPU references, host pins) so that making room on the GPU
            # below cannot evict a block this lease is about to read.
            sources: list[BlockPlan] = []
            known: list[BlockEntry | None] = [*entries, *[None] * (len(match.keys) - len(entries))]
            for key, entry, tier, label in zip(match.keys, known, match.tiers, match.labels):
                src = self._hold_source(key, entry, tier)
                if src is None:
                    shortfall = "part of the matched prefix left the lower tiers before acquire"
                    break
                src.label = self._label(src.source, tier, label)
                sources.append(src)
            skip = first_block_in_window(len(match.keys) * bs, window, bs)
            for i, src in enumerate(sources[:skip]):
                if src.source in ("host", "disk"):
                    self._drop_source(src)
                    sources[i] = BlockPlan(src.key, src.source, -1, ready=True, skipped=True, label=src.label)
        need = sum(1 for p in sources if p.source != "gpu")
        if need:
            self.spiller.make_gpu_room(need)
            if not self.h.exclusive:  # exclusive: loads from disk take no host slot (see _plan_block)
                self.spiller.ensure_host_free(sum(1 for p in sources if p.source in ("disk", "remote") and not p.skipped))
        plan: list[BlockPlan] = []
        with h.lock:
            for i, src in enumerate(sources):
                why = self._plan_block(src)
                if why is not None:
                    shortfall = why
                    for rest in sources[i:]:
                        self._drop_source(rest)
                    break
                plan.append(src)
        tokens = list(match.tokens[: len(plan) * bs]) if match.tokens is not None else None
        lease = StoreLease(tuple(p.key for p in plan), plan, node, bs, self.layout.num_layers, shortfall=shortfall,
                           tokens=tokens, salt=match.salt, chain=tuple(match.keys), window=window)
        if shortfall:
            log.info("acquire: %d of %d matched blocks planned: %s", len(plan), match.num_blocks, shortfall)
        self.prefetcher.start(lease)
        return lease

    def _live_prefix(self, match: StoreMatch) -> list[BlockEntry]:
        """The match's entries that are still indexed and live somewhere (under the lock).

        A match built without entry handles (from keys alone) is looked up by key.
        """
        entries = list(match.entries)
        if not entries and match.keys:
            entries = list(self.h.index.match_keys(match.keys, count_hits=False).entries)
        out: list[BlockEntry] = []
        for e in entries:
            if e.node is None or e.tier is None:
                break  # dropped, or lost its last copy, since the lookup
            out.append(e)
        return out

    def _hold_source(self, key: bytes, entry: BlockEntry | None, tier: str) -> BlockPlan | None:
        """Reference or pin where one block will be read from (under the lock); ``None``: nowhere known.

        ``tier`` is where the lookup found it; only the remote tier is taken on the lookup's word
        (the index never records remote copies).

        The returned plan's ``gpu_block`` is a placeholder (-1) until :meth:`_plan_block` for
        lower-tier sources.
        """
        h, pl = self.h, self.h.placement
        if entry is not None and entry.gpu_block is not None:
            pl.ref([entry.gpu_block])
            return BlockPlan(key, "gpu", entry.gpu_block, ready=True)
        pin = pl.pin_host(key)
        if pin is not None:
            return BlockPlan(key, "host", -1, host=pin, ready=True)
        if h.disk is not None and (entry is None or entry.on_disk) and tier != "remote":
            return BlockPlan(key, "disk", -1)  # phase 1 finds out if it is really there
        if h.remote is not None and tier == "remote":
            return BlockPlan(key, "remote", -1)  # likewise
        return None

    def _label(self, source: str, tier: str, label: str) -> str | None:
        """The name a lease block read from ``source`` is reported by, when not ``source`` (:attr:`BlockPlan.label`):
        the lookup's ``label`` while the block is still where the lookup found it (``tier``). A block that
        reached a daemon since is named by the daemon's first tier (a put lands in its host tier)."""
        if source == tier:
            return label if label != tier else None
        served = self.h.disk.served_as if source == "disk" and self.h.disk is not None else ()
        return served[0] if served else None

    def _drop_source(self, p: BlockPlan) -> None:
        """Undo :meth:`_hold_source` for a block that will not be planned (under the lock)."""
        if p.source == "gpu":
            self.h.placement.unref([p.gpu_block])
        self.prefetcher.release_host(p)

    def _plan_block(self, p: BlockPlan) -> str | None:
        """Take a GPU block and, for a disk or remote source, a host slot for ``p`` (under the lock); a string
        says why not. The host slot is the promotion: the loaded block stays in the host tier (not with
        exclusive tiers (``policy.placement``): then the block is staged privately and leaves the lower tiers once loaded)."""
        h, pl = self.h, self.h.placement
        if p.source == "gpu":
            return None
        got = h.pool.try_allocate(1)
        if got is None:
            return "GPU pool full: no free block to load into"
        p.gpu_block = got[0]
        if p.skipped:
            h.placeholders.add(p.gpu_block)
            return None
        if p.source == "host" or h.host is None:
            return None
        promoted = pl.pin_host(p.key)  # loaded into the host tier meanwhile
        if promoted is not None:
            p.source, p.host, p.ready = "host", promoted, True
            return None
        if self.h.exclusive:
            return None  # no promotion into host: the block goes to the GPU only (staged privately)
        try:
            p.host = pl.reserve_host(p.key)
        except BlockStateError:
            return None  # another lease is loading the same block into the host tier: stage privately
        if p.host is None:
            pl.unref([p.gpu_block])
            return "host tier full of pinned blocks: loaded fewer blocks"
        return None

    # --------------------------------------------------------------- release
    def release(self, lease: StoreLease) -> None:
        """End a lease: cancel unfinished loads, drop its GPU references and unpin its index path."""
        if lease.released:
            return
        lease.resolve()
        h = self.h
        if lease._phase2 is not None:
            lease._phase2.result()  # copies into the lease's GPU blocks are over
        if lease._phase1 is not None:
            with h.lock:  # after resolve only a block still planned can be in flight; a trimmed one is dropped and
                busy = any(p.in_flight for p in lease.plan)  # settles itself when its read returns (never waited for)
            if busy:
                lease._phase1.result()
        with h.lock:
            h.placeholders.difference_update(p.gpu_block for p in lease.plan if p.skipped)
            h.placement.unref([p.gpu_block for p in lease.plan])
            for p in lease.plan:
                self.prefetcher.release_host(p)
            if lease.node is not None:
                h.placement.unpin(lease.node)
            lease.released = True

    # ------------------------------------------------------ blocks and commit
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` GPU blocks for new tokens, evicting unused cached blocks first if needed.

        Blocks still being copied down by the write policy (or for the remote tier) hold a
        reference; when only they stand in the way, this waits for those copies. Raises
        :class:`OutOfBlocks` (nothing taken) when even that is not enough.
        """
        free = 0
        for attempt in range(3):
            self.spiller.make_gpu_room(n)  # copies down outside the lock
            with self.h.lock:
                if self.h.pool.num_free >= n:
                    return self.h.pool.allocate(n)
                free = self.h.pool.num_free
            if attempt == 0 and self.spiller.pending():
                self.spiller.wait()  # outside the lock: the copies need it to finish
            if attempt == 0 and self.remote_writer is not None and self.remote_writer.pending():
                self.remote_writer.wait()  # queued group writes hold GPU blocks until they are copied
        raise OutOfBlocks(n, free)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop the caller's reference on each block (cached ones stay in the index, now evictable)."""
        with self.h.lock:
            self.h.placement.unref(block_ids)

    def commit(self, keys: Sequence[bytes], block_ids: Sequence[int], tokens: Sequence[int] | None = None,
               salt: Salt = None) -> int:
        """Record full blocks (``keys[i]`` is in GPU block ``block_ids[i]``) in the index.

        ``tokens`` (the blocks' tokens; ``keys`` must be their chain under
        ``salt``) let later lookups find the blocks without hashing; without
        them the blocks are found by key only. The index takes its own
        reference on each block it records; the caller keeps its own. Keys
        already cached keep their copy (the caller's duplicate block is simply
        not recorded). Applies the write policy. Returns how many blocks were new.

        A lease's placeholder blocks (outside an attention window, see :meth:`acquire`) are never recorded as
        copies; if such a block has left every tier since, the commit stops before it (nothing after it can be
        chained).
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"commit: {len(keys)} keys but {len(block_ids)} blocks")
        h = self.h
        with h.lock:
            ids: list[int | None] = list(block_ids)
            if h.placeholders:
                for i, b in enumerate(block_ids):
                    if b in h.placeholders:
                        if h.index.get(keys[i]) is None:
                            keys, ids = keys[:i], ids[:i]
                            tokens = tokens[: i * self.layout.block_size] if tokens is not None else None
                            break
                        ids[i] = None
                if not keys:
                    return 0
            res = h.placement.insert(keys, ids, tokens=tokens, salt=salt)
            # The new entries are made only when a writer takes them (a GPU-only store defers them: see RadixNode).
            takes = self.spiller.takes_commits or self.remote_writer is not None
            new = res.new_entries if takes else []
            h.events.put_many("stored", keys[res.num_existing :], "gpu")
        if takes:
            self.spiller.on_commit(new)
            if self.remote_writer is not None:
                self.remote_writer.on_commit(new)
        return res.num_new

    def offload(self, tier: str) -> int:
        """Move every unused block out of ``tier`` (``"gpu"`` or ``"host"``) into the next tier down.

        For draining before a shutdown, and for tests that need a prefix to
        live in a given tier. Blocks in use stay. Returns how many moved.
        """
        h = self.h
        self.spiller.wait()
        if tier == "gpu":
            with h.lock:
                before = h.counters.gpu_evictions
            self.spiller.make_gpu_room(h.pool.num_blocks)
            with h.lock:
                return h.counters.gpu_evictions - before
        if tier == "host":
            if h.host is None:
                return 0
            return self.spiller.make_host_room(h.host.num_slots)
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
        """Per-tier counters and occupancy (a snapshot; changes nothing): :func:`~kvstore.store.stats.store_stats`."""
        return store_stats(self.h, self.prefetcher.budget, self.remote_writer)

    def drain_events(self) -> list[StoreEvent]:
        """Return and clear the store's event queue."""
        self.h.sync_tier_events()
        return self.h.events.drain()

    def flush(self) -> None:
        """Make every block committed before the call durable: wait for scheduled write-downs (remote ones
        too), write the blocks the disk tier lacks down to it (under ``write_back`` and
        ``write_through_selective``, those only the GPU or the host holds: :func:`~kvstore.store.durable.write_all_down`),
        then flush the disk tier. Changes where blocks live only by adding disk copies."""
        self.spiller.wait()
        if not self.spiller.rule.at_commit:
            write_all_down(self.h)
        if self.remote_writer is not None:
            self.remote_writer.wait()
        for _, tier in self.h.lower_tiers():
            tier.flush()

    def close(self) -> None:
        """Flush (every committed block reaches the disk tier), stop the workers and close the tiers."""
        self.spiller.wait()
        if not self.spiller.rule.at_commit:
            write_all_down(self.h)
        self.spiller.close()
        if self.remote_writer is not None:
            self.remote_writer.close()
        self.prefetcher.close()
        for _, tier in self.h.lower_tiers():
            tier.close()

    def check_integrity(self) -> None:
        """Raise if the index, the pool and the tiers disagree about any block."""
        from kvstore.store.check import check_store

        check_store(self.h)
