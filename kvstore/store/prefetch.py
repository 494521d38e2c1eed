"""Asynchronous loads of a matched prefix from the lower tiers back to the GPU.

A :class:`StoreLease` moves through two phases::

    acquire ─► phase 1 (worker): disk or remote ─► host slot, batch by batch, under the byte budget
    resolve ─► stop policy decides how many blocks are usable; the rest is cancelled
           ─► phase 2 (worker): host slot ─► GPU block, layer 0 first, ... layer n-1
    wait_layer(i) returns once layer i of every usable block is on the GPU

Stop policies: ``wait_complete`` waits for phase 1, but never past the load's
deadline (:class:`~kvstore.store.load_clock.LoadClock`: its bytes at the measured
bandwidth, with a floor), so a stalled disk or remote tier costs a request
that deadline, not the stall; ``best_effort`` takes what has arrived;
``timeout`` waits ``base + per_1k * tokens / 1000`` ms. Either way the rest
is recomputed, and a read still in flight then is dropped when it returns. Loaded blocks enter the index only after phase 2, so a
concurrent request never sees a GPU block before its bytes are there.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvstore.util.budget import ByteBudget
from kvstore.config.deadlines import DeadlinesConfig
from kvstore.config.schema import PolicyConfig
from kvstore.store.hierarchy import Hierarchy
from kvstore.store.host_slot import HostSlot
from kvstore.store.load_clock import LoadClock
from kvstore.store.radix import RadixNode
from kvstore.store.transfer import CopyStreams, LayerSync, copy_layer, default_copy_streams, staging_buffer

log = logging.getLogger("kvstore.prefetch")

PHASE1_SOURCES = ("disk", "remote")
"""Sources read into host memory by phase 1 before the GPU copy."""


@dataclass
class BlockPlan:
    """Where one block of a lease comes from and where it goes."""

    key: bytes
    source: str
    """``"gpu"`` (already there), ``"host"``, ``"disk"`` or ``"remote"`` (the last two are read in phase 1)."""
    gpu_block: int
    """The GPU block the lease holds (a reference) for this position."""
    host: HostSlot | None = None
    """Host slot read from (a pin) or loaded into (a reservation, pinned once published), while the lease uses it."""
    staging: torch.Tensor | None = None
    """Host buffer used instead of a slot when there is no host tier."""
    ready: bool = False
    """Phase 1 done for this block (always true for gpu and host sources)."""
    in_flight: bool = False
    """A phase-1 read into this block's buffer is running (its buffers must not be reused yet)."""
    dropped: bool = False
    """Trimmed by ``resolve`` while in flight: the phase-1 worker gives its resources back."""
    skipped: bool = False
    """Outside the reader's attention window: the GPU block only holds the position, nothing is read or copied
    (``source`` still says where the block is, for the per-tier counts)."""
    label: str | None = None
    """The name the block is reported by when it is not ``source``'s: read from a daemon (``source`` ``"disk"``),
    the daemon tier that held it at lookup (``"daemon:host"``, ``"daemon:disk"``, ``"daemon:remote"``)."""


@dataclass
class StoreLease:
    """A request's hold on a cached prefix: its GPU blocks, possibly still loading.

    Created by the store's ``acquire``; the engine calls :meth:`resolve` once,
    then :meth:`wait_layer` before reading each layer, then the store's
    ``release``.
    """

    keys: tuple[bytes, ...]
    plan: list[BlockPlan]
    node: RadixNode | None
    block_size: int
    num_layers: int
    shortfall: str | None = None
    """Why fewer blocks than matched were planned or loaded (``None`` when everything came)."""
    resolved_blocks: int | None = None
    load_wait_s: float = 0.0
    """Seconds spent waiting for loads in :meth:`resolve` and :meth:`wait_layer`."""
    released: bool = False
    tokens: list[int] | None = field(default=None, repr=False)
    """Tokens of the planned blocks (so loaded blocks can be indexed for token lookups)."""
    salt: object = field(default=None, repr=False)
    """Tenant salt of the keys."""
    chain: tuple[bytes, ...] = field(default=(), repr=False)
    """The matched keys from the chain's first block (``keys`` is a prefix of them): the remote tier
    finds a block's group by its position in this chain."""
    window: int = 0
    """The reader's attention window in tokens (0: full attention): a query at position ``q`` reads keys
    ``q - window < k <= q`` in every layer, so blocks wholly before the first query's window are not loaded."""
    _resolver: object = field(default=None, repr=False)
    _sync: LayerSync | None = field(default=None, repr=False)
    _phase1: Future[None] | None = field(default=None, repr=False)
    _phase2: Future[None] | None = field(default=None, repr=False)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _phase1_done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def block_ids(self) -> list[int]:
        """GPU block ids of the prefix, in order (after :meth:`resolve`: only the usable ones)."""
        n = len(self.plan) if self.resolved_blocks is None else self.resolved_blocks
        return [p.gpu_block for p in self.plan[:n]]

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV the lease provides (planned until resolved)."""
        return len(self.block_ids) * self.block_size

    def tokens_by_tier(self) -> dict[str, int]:
        """Usable tokens by the tier they came from (``"remote"``, or a daemon's tier such as ``"daemon:disk"``,
        appears when a block came from there)."""
        out = {"gpu": 0, "host": 0, "disk": 0}
        for p in self.plan[: len(self.block_ids)]:
            t = p.label or p.source
            out[t] = out.get(t, 0) + self.block_size
        return out

    def resolve(self) -> int:
        """Apply the stop policy, cancel what will not be used, start the GPU copies; returns cached tokens.

        Idempotent. After it returns, :attr:`block_ids` is final.
        """
        if self.resolved_blocks is None:
            self._resolver.resolve(self)  # type: ignore[attr-defined]
        return self.num_cached_tokens

    def wait_layer(self, layer: int) -> None:
        """Block until layer ``layer`` of every usable block is on the GPU."""
        self.resolve()
        assert self._sync is not None
        if not self._sync.is_set(layer):
            t0 = time.perf_counter()
            self._sync.wait(layer)
            self.load_wait_s += time.perf_counter() - t0
        else:
            self._sync.wait(layer)

    def wait(self) -> None:
        """Block until every usable block is fully on the GPU."""
        for layer in range(self.num_layers):
            self.wait_layer(layer)
        if self._phase2 is not None:
            self._phase2.result()

    def reads_done(self, timeout_s: float | None = None) -> bool:
        """Wait until no phase-1 read of this lease is in flight (at most ``timeout_s``); ``True`` if none is.

        A lease released while a read it dropped is still running (a stalled disk) does not wait for it: the
        read gives its GPU block and host slot back when it returns. This says when that has happened."""
        return self._phase1_done.wait(timeout_s)


def first_block_in_window(first_query: int, window: int, block_size: int) -> int:
    """The first block a query at position ``first_query`` or later reads with a ``window``-token sliding window
    (keys ``q - window < k <= q``); 0 for full attention (``window`` 0)."""
    if window <= 0:
        return 0
    return max(0, first_query - window + 1) // block_size


class Prefetcher:
    """Runs lease loads on worker threads with a bound on bytes in flight.

    ``streams`` issues the GPU copies asynchronously (default: CUDA streams for
    a pool on CUDA, plain copies on the CPU); tests pass fakes to drive the
    stream path with a CPU pool.
    """

    def __init__(
        self, h: Hierarchy, policy: PolicyConfig, workers: int = 2, streams: CopyStreams | None = None,
        deadlines: DeadlinesConfig | None = None,
    ) -> None:
        self.h = h
        self.policy = policy
        self.clock = LoadClock(deadlines or DeadlinesConfig())
        """Phase 1's deadline (``wait_complete``), from the bandwidth of earlier phase-1 reads."""
        self.streams = streams if streams is not None else default_copy_streams(h.pool.device)
        self.budget = ByteBudget(int(policy.max_inflight_bytes))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-prefetch")

    # ---------------------------------------------------------------- start
    def start(self, lease: StoreLease) -> None:
        """Begin phase 1 for the lease's disk blocks (if any)."""
        lease._resolver = self
        lease._sync = LayerSync(lease.num_layers, self.streams)
        if any(p.source in PHASE1_SOURCES and not p.skipped for p in lease.plan):
            lease._phase1 = self._pool.submit(self._phase1, lease)
        else:
            lease._phase1_done.set()

    def _phase1(self, lease: StoreLease) -> None:
        h = self.h
        bpb = h.layout.bytes_per_block
        todo = [(pos, p) for pos, p in enumerate(lease.plan) if p.source in PHASE1_SOURCES and not p.skipped]
        batch_blocks = max(1, min(32, self.budget.limit // bpb))
        try:
            i = 0
            while i < len(todo) and not lease._cancel.is_set():
                source = todo[i][1].source
                n = batch_blocks
                if source == "remote":  # end batches on group boundaries so no group is fetched twice
                    assert h.remote is not None
                    g = h.remote.group_blocks
                    n = max(g, (todo[i][0] + batch_blocks) // g * g - todo[i][0])
                run = todo[i : i + n]
                run = run[: next((j for j, t in enumerate(run) if t[1].source != source), len(run))]
                first_pos = run[0][0]
                batch = [p for _, p in run]
                nbytes = len(batch) * bpb
                self.budget.acquire(nbytes)
                try:
                    with h.lock:
                        if lease._cancel.is_set():
                            break
                        for p in batch:
                            p.in_flight = True
                    dests = [self._dest(p) for p in batch]
                    t_read = time.monotonic()
                    if source == "remote":  # a contiguous run of the chain: read by position
                        assert h.remote is not None
                        found = h.remote.load(lease.chain or lease.keys, first_pos, dests)
                    else:
                        assert h.disk is not None
                        found = h.disk.get([p.key for p in batch], dests)
                finally:
                    self.budget.release(nbytes)
                self.clock.record(sum(found) * bpb, time.monotonic() - t_read)
                n_ok = 0
                with h.lock:
                    pl = h.placement
                    prefix_ok = True
                    for p, ok in zip(batch, found):
                        p.in_flight = False
                        if not ok and source == "disk":
                            pl.lost(p.key, "disk")  # the same path as an eviction: never reported again
                        prefix_ok = prefix_ok and ok
                        if p.dropped:
                            self._settle_dropped(p, ok)
                        elif prefix_ok:
                            n_ok += 1
                            p.ready = True
                            if p.host is not None:
                                pl.publish(p.host)  # stays pinned by the lease until phase 2 has copied it
                if n_ok < len(batch) and not lease._cancel.is_set():
                    lease.shortfall = f"{source} tier returned {n_ok} of {len(batch)} blocks (missing, corrupt or unreachable)"
                    break
                i += len(batch)
        finally:
            lease._phase1_done.set()

    def _dest(self, p: BlockPlan) -> torch.Tensor:
        if p.host is not None:
            return self.h.placement.view(p.host)
        if p.staging is None:
            gpu = self.h.pool.block_bytes(p.gpu_block)
            p.staging = gpu if gpu.device.type == "cpu" else staging_buffer(self.h.layout, pin=True)
        return p.staging

    # -------------------------------------------------------------- resolve
    def load_deadline_s(self, lease: StoreLease) -> float:
        """The longest ``wait_complete`` waits for the lease's phase-1 reads (:class:`LoadClock` of their bytes)."""
        n = sum(1 for p in lease.plan if p.source in PHASE1_SOURCES and not p.skipped)
        return self.clock.deadline_s(n * self.h.layout.bytes_per_block)

    def timeout_s(self, lease: StoreLease) -> float:
        """The ``timeout`` policy's budget for this lease, in seconds."""
        tokens = len(lease.plan) * lease.block_size
        ms = self.policy.prefetch_timeout_base_ms + self.policy.prefetch_timeout_per_1k_tokens_ms * tokens / 1000
        return ms / 1000.0

    def resolve(self, lease: StoreLease) -> None:
        """See :meth:`StoreLease.resolve`."""
        t0 = time.perf_counter()
        mode = self.policy.prefetch
        if mode == "wait_complete":
            if not lease._phase1_done.wait(self.load_deadline_s(lease)):
                log.warning("a load of %d blocks missed its deadline (%.2f s); the rest is recomputed",
                            len(lease.plan), self.load_deadline_s(lease))
        elif mode == "timeout":
            lease._phase1_done.wait(self.timeout_s(lease))
        lease._cancel.set()
        lease.load_wait_s += time.perf_counter() - t0
        with self.h.lock:  # ready flags change under this lock, so the decision below is consistent
            usable = 0
            for p in lease.plan:
                if p.source in PHASE1_SOURCES and not p.ready:
                    break
                usable += 1
            first = first_block_in_window(usable * lease.block_size, lease.window, lease.block_size)
            if any(p.skipped for p in lease.plan[first:usable]):
                # The policy cut the prefix so far back that its window reaches blocks never loaded.
                lease.shortfall = (f"{mode}: {usable} of {len(lease.plan)} blocks ready, and their attention window "
                                   "needs blocks that were not loaded (outside the full prefix's window)")
                usable = 0
            self._trim(lease, usable)
        lease.resolved_blocks = usable
        to_copy = [p for p in lease.plan[:usable] if p.source != "gpu" and not p.skipped]
        assert lease._sync is not None
        if to_copy:
            lease._phase2 = self._pool.submit(self._phase2, lease, to_copy)
        else:
            lease._sync.mark_all()

    def _trim(self, lease: StoreLease, usable: int) -> None:
        """Give back what the blocks after ``usable`` held (called under the lock).

        A block whose read is still in flight is marked ``dropped``; the
        phase-1 worker releases it when the read returns, so no buffer is
        reused while a thread may still write into it.
        """
        h = self.h
        trimmed = lease.plan[usable:]
        if trimmed and lease.shortfall is None:
            lease.shortfall = f"{self.policy.prefetch}: {len(trimmed)} of {len(lease.plan)} blocks not loaded in time"
        h.counters.load_failures += len(trimmed)
        for p in trimmed:
            if p.in_flight:
                p.dropped = True
                continue
            self._give_back(p)
        del lease.plan[usable:]

    def _settle_dropped(self, p: BlockPlan, ok: bool) -> None:
        """Release a block trimmed while its read was in flight (called under the lock)."""
        if p.host is not None and ok:
            self.h.placement.publish(p.host)  # intact data: keep it on host as a promotion
        self._give_back(p)

    def _give_back(self, p: BlockPlan) -> None:
        """Drop what a planned block holds: its GPU reference and its host handle (called under the lock)."""
        pl = self.h.placement
        if p.skipped:
            self.h.placeholders.discard(p.gpu_block)
        pl.unref([p.gpu_block])
        self.release_host(p)

    def release_host(self, p: BlockPlan) -> None:
        """Give back a planned block's host handle, if any (called under the lock)."""
        if p.host is None:
            return
        pl = self.h.placement
        if p.host.state == "reserved":
            pl.abort(p.host)
        else:
            pl.release(p.host)
        p.host = None

    def _phase2(self, lease: StoreLease, to_copy: list[BlockPlan]) -> None:
        h = self.h
        assert lease._sync is not None
        try:
            dsts = [h.pool.block_bytes(p.gpu_block) for p in to_copy]
            srcs = [self._src(p) for p in to_copy]
            same = [d.data_ptr() == s.data_ptr() for d, s in zip(dsts, srcs)]
            dsts = [d for d, x in zip(dsts, same) if not x]
            srcs = [s for s, x in zip(srcs, same) if not x]
            if self.streams is None:
                for layer in range(lease.num_layers):
                    copy_layer(h.layout, dsts, srcs, layer)
                    lease._sync.mark(layer)
            else:
                stream = self.streams.new_stream()
                with self.streams.use(stream):
                    for layer in range(lease.num_layers):
                        copy_layer(h.layout, dsts, srcs, layer)
                        lease._sync.mark(layer, stream)
                # _register_loaded unpins the host slots: no copy may still be reading them.
                self.streams.synchronize(stream)
            self._register_loaded(lease, to_copy)
        finally:
            lease._sync.mark_all()

    def _src(self, p: BlockPlan) -> torch.Tensor:
        if p.host is not None:
            return self.h.placement.view(p.host)
        assert p.staging is not None
        return p.staging

    def _register_loaded(self, lease: StoreLease, loaded: list[BlockPlan]) -> None:
        """Record the new GPU copies in the index (the index takes its own reference) and unpin their host slots.

        With exclusive tiers (``policy.placement``) the loaded blocks then leave host (their disk copies stay)."""
        h = self.h
        with h.lock:
            keys = list(lease.keys[: lease.resolved_blocks])
            # A block held without its data is indexed as where the lookup found it: on disk (so a disk hit
            # probed beyond the index joins it, like the loaded ones), or in host RAM, where the index had it;
            # if that host copy has gone meanwhile, nothing after it can be chained.
            for i, p in enumerate(lease.plan[: len(keys)]):
                if p.skipped and p.source == "host" and h.index.get(p.key) is None:
                    del keys[i:]
                    break
            pos = {p.key: p for p in loaded}
            skipped_on_disk = {p.key for p in lease.plan if p.skipped and p.source == "disk"}
            gpu = [pos[k].gpu_block if k in pos else None for k in keys]
            host = [pos[k].host.slot if k in pos and pos[k].host is not None else None for k in keys]  # type: ignore[union-attr]
            disk = [(k in pos and pos[k].source == "disk") or k in skipped_on_disk for k in keys]
            toks = lease.tokens[: len(keys) * lease.block_size] if lease.tokens is not None else None
            h.placement.insert(keys, gpu, host, disk, toks, lease.salt)  # type: ignore[arg-type]
            for p in loaded:
                h.counters.loaded_blocks[p.source] += 1
                h.events.put("loaded", p.key, "gpu")
                self.release_host(p)
            if self.h.exclusive:
                for p in loaded:
                    h.placement.leave_host(p.key)

    def close(self) -> None:
        """Stop the workers after the running loads finish."""
        self._pool.shutdown(wait=True)
