"""Scheduler side of kvstore's full vLLM connector: what is cached, what to load, what to save.

Per request it keeps kvstore's key chain of the request's tokens (one key
per vLLM block: the layout's ``block_size`` is vLLM's block size) and how
many of its blocks kvstore already has. ``get_num_new_matched_tokens`` asks
kvstore how many blocks after vLLM's own prefix-cache hit are stored;
``update_state_after_alloc`` records which GPU blocks receive them;
``build_connector_meta`` sends those loads, and a save for every block that
becomes full in the step, to the workers. Loads are synchronous (they finish
before each layer runs, see the worker side), so a request never waits in
``WAITING_FOR_REMOTE_KVS`` and ``request_finished`` holds no blocks.

The blocks vLLM allocates for a load start after vLLM's own prefix-cache hit,
which only ``get_num_new_matched_tokens`` is told: vLLM sets
``request.num_computed_tokens`` after ``update_state_after_alloc`` (0.32 and
0.33), so the start is kept from the first call for the second. After a
preemption vLLM asks again from 0 (or from its cache's new hit), so the start
is taken afresh at each ask.

Hybrid models (several KV cache groups under vLLM's hybrid allocator: sliding-window
layers beside full-attention ones): a kvstore block still carries one position of
every layer, and each group's block of that position is loaded into, or saved from,
that group's block table; a sliding-window group's null block (positions before the
window) is skipped, so only the window is written. vLLM accepts a failed load of
several groups only for a whole request, so these loads are vLLM's asynchronous
kind: the request waits one step in ``WAITING_FOR_REMOTE_KVS`` while the workers
load, and a failure makes vLLM recompute it (and kvstore offer it nothing more).

Roles: a ``kv_consumer`` engine only loads, a ``kv_producer`` only saves
(disaggregated prefill through the store); ``kv_both`` does both.

Never stuck: the lookup runs on a background thread, and the scheduler
waits for it at most :data:`LOOKUP_INLINE_S`. A lookup not answered by then
makes ``get_num_new_matched_tokens`` answer ``None`` ("not yet, ask again":
vLLM skips the request this step and schedules the others); the lookup
itself ends within the store's ``deadlines.lookup_ms`` (a miss after that),
and behind an open breaker it is an instant miss. So a paused daemon never
holds vLLM's scheduler loop, and a request waits at most twice the lookup
deadline for its answer (queueing behind other lookups included: then it is
a miss).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connectors.engine_keys import PromptKeys
from connectors.engine_store import EngineBlockStore
from connectors.vllm.connector_meta import NULL, BlockTransfer, KVStoreConnectorMetadata
from connectors.vllm.shards import Shard
from kvstore.layout import KVLayout
from kvstore.store.load_clock import LoadClock
from kvstore.store.load_cost import LoadCost
from kvstore.util.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

LOOKUP_INLINE_S = 0.005
"""Longest the scheduler waits for a lookup before answering vLLM "not yet" (a healthy daemon answers in well
under a millisecond; the lookup goes on in the background until the store's lookup deadline)."""


@dataclass
class _RequestState:
    request: Request
    chain: PromptKeys
    stored_blocks: int = 0
    """Blocks ``[0, stored_blocks)`` are in kvstore, loaded from it, or already sent to be saved."""
    load_start: int = 0
    """First block of the load ``get_num_new_matched_tokens`` offered: the block after vLLM's own prefix hit."""
    pending_load: BlockTransfer | None = None
    last_load: tuple[tuple[int, ...], BlockTransfer] | None = None
    """The latest load sent to the workers, with the position in the request of each of its blocks."""
    load_failed: bool = False
    """An asynchronous load of it failed: vLLM recomputes it, and kvstore offers it nothing more."""
    lookup: tuple[int, int, Future[int], float] | None = None
    """The lookup under way: the blocks it counts from and up to, how many it finds (from position 0), and when
    it was asked (a request waits for it at most twice the lookup deadline, queueing behind others included)."""
    load_worth_s: float | None = None
    """How long its planned load is worth waiting for (its decision's ``worth_s``)."""


class KVStoreConnectorScheduler:
    """The scheduler half of :class:`~connectors.vllm.connector.KVStoreConnector`."""

    def __init__(self, store: EngineBlockStore, layout: KVLayout, loads: bool = True, saves: bool = True,
                 shards: Sequence[Shard] = (Shard(),), groups: int = 1) -> None:
        """``shards``: every tensor-parallel rank; a block counts as cached only when each rank's shard is stored.
        ``groups``: vLLM's KV cache groups (more than one: a hybrid model, loaded asynchronously)."""
        self.store = store
        self.shards = list(shards)
        self.layout = layout
        self.loads = loads
        """Whether this engine loads from kvstore (``False`` for a ``kv_producer``)."""
        self.saves = saves
        """Whether this engine saves to kvstore (``False`` for a ``kv_consumer``)."""
        self.groups = groups
        self.async_loads = groups > 1
        self.load_steps: dict[str, float] = {"probe": 0.0}
        """Seconds spent in each step of a load on this side: ``probe`` (asking the store what it holds)."""
        """Loads are vLLM's asynchronous kind (see the module docstring)."""
        self._requests: dict[str, _RequestState] = {}
        self._kv_cache_manager: KVCacheManager | None = None
        self._epoch: bytes | None = None
        """Set by :meth:`reset`: mixed into every key's salt, so nothing stored before the reset is found."""
        self._lookups = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-vllm-lookup")
        self.cost = LoadCost(LoadClock(store.deadlines), store.deadlines.always_load)
        """Load or recompute: what the workers measured (:meth:`step_done`): their loads' rate against the
        engine's prefill rate (a forward's tokens over its time)."""
        self._ratelog = RateLimitedLog(log)

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        """Where the GPU block ids of scheduled requests are read from."""
        self._kv_cache_manager = manager

    def _chain(self, request: Request) -> PromptKeys:
        salt = self.store.salt(request.cache_salt)
        if self._epoch is not None:
            tenant = salt.encode("utf-8") if isinstance(salt, str) else b"\x00" if salt is None else b"\x01" + salt
            salt = b"kvstore.vllm.reset|" + self._epoch + b"|" + tenant
        return PromptKeys(self.layout, salt)

    def _state(self, request: Request) -> _RequestState:
        st = self._requests.get(request.request_id)
        if st is None:
            st = _RequestState(request, self._chain(request))
            self._requests[request.request_id] = st
        return st

    def reset(self) -> None:
        """Load nothing stored before now: keys take a fresh random epoch; known requests start new chains."""
        self._epoch = os.urandom(16)
        for st in self._requests.values():
            st.chain = self._chain(st.request)
            st.stored_blocks, st.pending_load, st.last_load, st.load_failed = 0, None, None, False
            st.lookup = None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens after ``num_computed_tokens`` whose blocks kvstore holds (loaded synchronously: ``False``), or
        ``None`` while the lookup has not answered (vLLM asks again next step; see the module docstring).

        The last prompt token is always computed (vLLM needs its logits), so at most
        ``(num_tokens - 1) // block_size`` blocks count.
        """
        st = self._state(request)
        bs = self.layout.block_size
        first, last = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        st.stored_blocks = max(st.stored_blocks, first)  # vLLM's own cache had them: computed here, so saved here
        st.load_start = first
        if not self.loads:
            if self.saves:  # a producer: its daemon learns which chain (and remote groups) its saves belong to
                full = st.chain.keys(request.all_token_ids, request.num_tokens // bs)
                for shard in self.shards:
                    self.store.announce(shard.keys(full))
            return 0, False
        if last <= first or st.load_failed:
            st.lookup = None
            return 0, False
        if st.lookup is None or st.lookup[:2] != (first, last):
            chain = st.chain.keys(request.all_token_ids, last)
            st.lookup = (first, last, self._lookups.submit(self._probe, chain, first), time.monotonic())
        try:
            found = st.lookup[2].result(LOOKUP_INLINE_S)
        except FutureTimeout:
            if time.monotonic() - st.lookup[3] < 2 * self.store.deadlines.lookup_ms / 1000:
                return None, False  # not yet: vLLM schedules the others and asks again
            st.lookup[2].cancel()  # queued behind other lookups past its deadline: a miss, computed now
            st.lookup = None
            return 0, False
        st.lookup = None
        hits = found - first
        if hits > 0:
            decision = self.cost.decide(hits, bs, self.layout.bytes_per_block)
            st.load_worth_s = decision.worth_s
            if not decision.load:  # expected to arrive later than vLLM computes it: recomputed
                self._ratelog.warning("recompute", "kvstore: recomputing a %d-block prefix rather than loading it: "
                                   "expected load %.3f s, prefill %.3f s (measured; deadlines.always_load turns "
                                   "this off)", hits, decision.expected_load_s, decision.expected_compute_s or 0.0)
                hits = 0
        return hits * bs, self.async_loads and hits > 0

    def _probe(self, chain: list[bytes], first: int) -> int:
        """Blocks of ``chain`` from position 0 every rank's shard has, given the engine holds the first ``first``
        (the whole chain: a daemon's remote tier groups by position; per rank: the least of the ranks')."""
        t0 = time.perf_counter()
        try:
            return min(self.store.probe(shard.keys(chain), first) for shard in self.shards)
        finally:
            self.load_steps["probe"] += time.perf_counter() - t0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of the ``num_external_tokens`` matched tokens into the blocks vLLM allocated for them."""
        if num_external_tokens == 0:
            return
        st = self._state(request)
        bs = self.layout.block_size
        first = st.load_start  # vLLM's own prefix hit (request.num_computed_tokens is still 0 here)
        n = num_external_tokens // bs
        allocated = [[NULL if b.is_null else b.block_id for b in group[first : first + n]] for group in blocks.blocks]
        keys = st.chain.keys(request.all_token_ids, first + n)[first:]
        # Sliding-window attention: positions before the window get vLLM's null block (nothing reads it), so
        # only the blocks inside the window are loaded; a position no group needs is not read at all.
        kept = [i for i in range(n) if any(group[i] != NULL for group in allocated)]
        st.pending_load = BlockTransfer(request.request_id, tuple(tuple(g[i] for i in kept) for g in allocated),
                                        tuple(keys[i] for i in kept))
        st.last_load = (tuple(first + i for i in kept), st.pending_load)
        st.stored_blocks = max(st.stored_blocks, first + n)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        """This step's loads (planned at allocation) and saves (blocks the step fills)."""
        meta = KVStoreConnectorMetadata()
        bs = self.layout.block_size
        meta.scheduled_tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        worth: list[float | None] = []
        for st in self._requests.values():  # an asynchronous load's request is not scheduled in its step
            if st.pending_load is not None:
                (meta.async_loads if self.async_loads else meta.loads).append(st.pending_load)
                st.pending_load = None
                worth.append(st.load_worth_s)
        if worth and None not in worth:  # the step's loads are worth waiting for until the last of them is
            meta.load_deadline_s = max(w for w in worth if w is not None)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            st = self._requests.get(req_id)
            if st is None:
                continue
            full = min(st.request.num_computed_tokens + n, st.request.num_tokens) // bs
            if full <= st.stored_blocks or not self.saves:
                continue
            assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
            groups = [g[st.stored_blocks : full] for g in self._kv_cache_manager.get_block_ids(req_id)]
            keys = st.chain.keys(st.request.all_token_ids, full)[st.stored_blocks :]
            null = self._null_block_id()
            # a position a sliding window already dropped in some group cannot be stored whole: skipped
            kept = [i for i in range(len(keys)) if all(g[i] != null for g in groups)]
            meta.saves.append(BlockTransfer(req_id, tuple(tuple(g[i] for i in kept) for g in groups),
                                            tuple(keys[i] for i in kept)))
            st.stored_blocks = full
        return meta

    def _null_block_id(self) -> int | None:
        """vLLM's null block (what a sliding window's blocks before the window become), if the manager has one."""
        pool = getattr(self._kv_cache_manager, "block_pool", None)
        null = getattr(pool, "null_block", None)
        return None if null is None else int(null.block_id)

    def step_done(self, worker_clock: tuple[float, float] | None, forward: tuple[int, float] | None) -> None:
        """What the workers measured, from their stats in a step's output: ``worker_clock``, their loads'
        bandwidth and latency; ``forward``, tokens computed and seconds taken by forwards that loaded nothing."""
        if worker_clock is not None:
            self.cost.clock.adopt(*worker_clock)
        if forward is not None:
            self.cost.record_prefill(*forward)

    def on_load_errors(self, invalid_block_ids: set[int], failed_requests: set[str] = frozenset()) -> None:
        """Blocks the workers could not load will be recomputed: save them again from the first failed one on.

        ``failed_requests``: requests whose asynchronous load failed (hybrid models); vLLM recomputes each
        whole, so kvstore offers it nothing more and saves it again from its own prefix hit on."""
        for req_id in failed_requests:
            st = self._requests.get(req_id)
            if st is not None:
                st.load_failed = True
                st.stored_blocks = min(st.stored_blocks, st.load_start)
        if not invalid_block_ids:
            return
        for st in self._requests.values():
            if st.last_load is None:
                continue
            positions, load = st.last_load
            failed = [i for i, b in enumerate(load.block_ids[0]) if b in invalid_block_ids]
            if failed:
                st.stored_blocks = min(st.stored_blocks, positions[failed[0]])

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Saves are copied out within their step, so no block is held (``False``)."""
        self._requests.pop(request.request_id, None)
        return False, None

    def close(self) -> None:
        """Stop the lookup thread (a lookup under way ends at its deadline)."""
        self._lookups.shutdown(wait=False, cancel_futures=True)
