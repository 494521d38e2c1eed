"""Worker side of kvstore's full vLLM connector: copies between vLLM's paged KV cache and kvstore.

One kvstore block is one vLLM block of every layer: the layers' block
slices (each ``page_size_bytes``: K and V of ``block_size`` tokens) one after
another, in the order of the KV cache group's layer names.

Loads map kvstore's per-layer lease onto ``wait_for_layer_load``:
``start_load_kv`` starts one background job per step that reads the blocks
from kvstore into a host staging buffer, then copies them into the paged
cache layer by layer, setting one event per layer; ``wait_for_layer_load``
waits for that layer's event only, so layer 0 runs while later layers are
still being copied. A block kvstore does not return (evicted meanwhile, or
corrupt: kvstore deletes a block failing its checksum) is reported by
``get_block_ids_with_load_errors`` and vLLM recomputes from it on.

A load has a deadline (:meth:`~connectors.engine_store.EngineBlockStore.load_deadline_s`
of its bytes, twice: the read and the copies into the cache). The forward
never waits past it: a load still running then is abandoned (under its
lock, so no layer is written after), every block of it is reported failed
and vLLM recomputes them. Late bytes are never written.

Hybrid models (several KV cache groups): each layer's slice goes to, or comes from,
the block of its own group (``BlockTransfer.block_ids[group]``), and a group's
:data:`~connectors.vllm.connector_meta.NULL` position (before a sliding window) is
not written. Their loads are vLLM's asynchronous kind (``async_loads``): done in
``start_load_kv`` before it returns, and reported, failed or not, by
:meth:`KVStoreConnectorWorker.take_finished_loads`.

Saves: ``save_kv_layer`` copies the layer's slice of the blocks the step
fills into a host staging buffer as each layer finishes; ``wait_for_save``
hands the staged blocks to a bounded background writer
(:class:`~connectors.save_queue.SaveQueue`) and returns at once: vLLM may
reuse the GPU blocks (their bytes are in the staging copy), and a slow daemon
never holds the step (a save that does not fit the queue is dropped and
counted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from connectors.engine_store import EngineBlockStore
from connectors.save_queue import SaveQueue
from connectors.vllm.connector_meta import NULL, BlockTransfer, KVStoreConnectorMetadata
from connectors.vllm.shards import Shard
from kvstore.layout import KVLayout

log = logging.getLogger(__name__)


class _PagedCache:
    """vLLM's per-layer KV tensors seen as blocks: ``[layer] -> tensor`` with one axis of ``num_blocks``."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int,
                 page_bytes: int) -> None:
        missing = [n for n in layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches: no KV cache for layer(s) {missing}")
        self.layers = list(layer_names)
        self.tensors = [kv_caches[n] for n in layer_names]
        self.axes = [_block_axis(n, t, num_blocks) for n, t in zip(layer_names, self.tensors)]
        self.page_bytes = page_bytes
        self.on_cuda = self.tensors[0].is_cuda
        """Copies into the cache are asynchronous (CUDA): :meth:`fence` must wait for them."""
        for name, t, axis in zip(layer_names, self.tensors, self.axes):
            got = t.select(axis, 0).numel() * t.element_size()
            if got != page_bytes:
                raise ValueError(f"KV cache of layer {name} holds {got} bytes per block, expected {page_bytes}")

    def read(self, layer: int, block_ids: Sequence[int]) -> torch.Tensor:
        """``[len(block_ids), page_bytes]`` uint8 copy of those blocks of ``layer`` (on the cache's device)."""
        t, axis = self.tensors[layer], self.axes[layer]
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=t.device)
        blocks = t.index_select(axis, idx).movedim(axis, 0).contiguous()
        return blocks.view(torch.uint8).reshape(len(block_ids), -1)

    def write(self, layer: int, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Put ``data`` (``[len(block_ids), page_bytes]`` uint8, any device) into those blocks of ``layer``."""
        t, axis = self.tensors[layer], self.axes[layer]
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=t.device)
        shape = list(t.shape)
        shape.pop(axis)
        src = data.to(t.device, non_blocking=True).view(t.dtype).reshape(len(block_ids), *shape)
        t.index_copy_(axis, idx, src.movedim(0, axis))

    def fence(self) -> None:
        """Return once the copies this thread issued have landed (CUDA: sync its current stream; CPU: they have)."""
        if self.on_cuda:
            torch.cuda.current_stream(self.tensors[0].device).synchronize()


def _block_axis(name: str, t: torch.Tensor, num_blocks: int) -> int:
    """The block axis of a layer's KV tensor: ``[2, num_blocks, ...]`` (K/V first) or ``[num_blocks, ...]``."""
    if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return 1
    if t.shape[0] == num_blocks:
        return 0
    raise ValueError(f"KV cache of layer {name} has shape {tuple(t.shape)}: no block axis of size {num_blocks} "
                     f"in front (expected [2, num_blocks, ...] or [num_blocks, ...])")


class _StepLoad:
    """One step's loads: a background read from kvstore, then a copy per layer, each announced by an event.

    Waited for until ``deadline`` (monotonic) at most: past it the load is abandoned (:meth:`abandon`) and its
    thread writes no further layer."""

    def __init__(self, num_layers: int, deadline: float = float("inf"), all_block_ids: set[int] = frozenset()) -> None:
        self.layer_done = [threading.Event() for _ in range(num_layers)]
        self.failed_block_ids: set[int] = set()
        """Group 0's blocks left unfilled (what vLLM recomputes from, one KV cache group only)."""
        self.complete = True
        """Every block was found and written."""
        self.future: Future[None] | None = None
        self.deadline = deadline
        self.all_block_ids = set(all_block_ids)
        self.lock = threading.Lock()
        """Held by the loading thread while it writes a layer, and by :meth:`abandon`."""
        self.abandoned = False
        self.read_deadline_s: float | None = None
        """The read from kvstore gives up after this (``None``: the store's own deadline)."""

    def abandon(self) -> None:
        """Past the deadline: no layer is written from now on, and every block counts as failed (recomputed)."""
        with self.lock:
            if not self.abandoned:
                self.abandoned = True
                self.complete = False
                self.failed_block_ids = set(self.all_block_ids)
                log.warning("kvstore load of %d blocks missed its deadline; vLLM recomputes them",
                            len(self.all_block_ids))
        for ev in self.layer_done:
            ev.set()

    def wait_layer(self, layer: int) -> None:
        if not self.layer_done[layer].wait(max(0.0, self.deadline - time.monotonic())):
            self.abandon()

    def wait(self) -> None:
        for layer in range(len(self.layer_done)):
            self.wait_layer(layer)
        if self.future is not None and not self.abandoned:
            try:
                self.future.result(max(0.0, self.deadline - time.monotonic()))
            except TimeoutError:
                self.abandon()


class KVStoreConnectorWorker:
    """The worker half of :class:`~connectors.vllm.connector.KVStoreConnector`."""

    def __init__(self, store: EngineBlockStore, layout: KVLayout, layer_names: Sequence[str], num_blocks: int,
                 page_bytes: int, shard: Shard = Shard(), layer_groups: Sequence[int] | None = None) -> None:
        """``shard``: this worker's tensor-parallel rank; it stores and loads its shard under its own keys.
        ``layer_groups``: the KV cache group of each of ``layer_names`` (default: all in group 0)."""
        if page_bytes * len(layer_names) != layout.bytes_per_block:
            raise ValueError(f"{len(layer_names)} layers of {page_bytes} bytes per block do not make the layout's "
                             f"{layout.bytes_per_block}-byte block")
        self.store = store
        self.layout = layout
        self.shard = shard
        self.layer_names = list(layer_names)
        self._layer_index = {n: i for i, n in enumerate(layer_names)}
        self.layer_groups = list(layer_groups) if layer_groups is not None else [0] * len(self.layer_names)
        if len(self.layer_groups) != len(self.layer_names):
            raise ValueError(f"{len(self.layer_groups)} layer groups for {len(self.layer_names)} layers")
        self.num_blocks = num_blocks
        self.page_bytes = page_bytes
        self.cache: _PagedCache | None = None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-vllm-load")
        self.save_queue = SaveQueue(store, int(store.deadlines.save_queue), name="kvstore-vllm-save")
        self._load: _StepLoad | None = None
        self._load_errors: set[int] = set()
        self._saves: list[BlockTransfer] = []
        self._save_staging: torch.Tensor | None = None  # [n_blocks, layers, page_bytes] host copy of this step's saves
        self._staged: list[bool] = []  # per layer: save_kv_layer copied it this step
        self._loads_done: set[str] = set()
        self._loads_failed: set[str] = set()
        self.forward_time = [0, 0.0]
        """Tokens computed and seconds taken by this worker's forwards that loaded nothing from kvstore (start of
        :meth:`forward_begins` to ``wait_for_save``): the engine's prefill rate, for the scheduler's decisions."""
        self._forward: tuple[float, int] | None = None
        self.load_steps: dict[str, float] = {"read": 0.0, "write": 0.0}
        """Seconds spent in each step of this worker's loads: ``read`` (the store's copy out of its tiers, the
        daemon's arena or disk, into a staging buffer) and ``write`` (the staging buffer into vLLM's KV cache)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Attach vLLM's paged KV tensors (checked: one block axis, ``page_bytes`` per block per layer)."""
        self.cache = _PagedCache(kv_caches, self.layer_names, self.num_blocks, self.page_bytes)

    def _cache(self) -> _PagedCache:
        if self.cache is None:
            raise RuntimeError("KVStoreConnector: register_kv_caches was not called")
        return self.cache

    # ----------------------------------------------------------------- loads
    def start_load_kv(self, meta: KVStoreConnectorMetadata) -> None:
        """Start this step's loads in the background (returns at once; asynchronous-kind loads are done before
        it returns: their requests are not in this step's forward); prepare the step's saves."""
        self._saves = list(meta.saves)
        n_save = sum(len(s.keys) for s in self._saves)
        self._save_staging = torch.empty((n_save, len(self.layer_names), self.page_bytes), dtype=torch.uint8) \
            if n_save else None
        self._staged = [False] * len(self.layer_names)
        self._load = None
        for transfer in meta.async_loads:  # their requests wait for them: loaded here, reported by take_finished_loads
            async_load = self._new_load([transfer])
            try:
                self._run_load(async_load, [transfer])
            except Exception:  # logged; every block counts as failed
                pass
            self._loads_done.add(transfer.req_id)
            if not async_load.complete:
                self._loads_failed.add(transfer.req_id)
        if not meta.loads:
            return
        load = self._new_load(list(meta.loads), meta.load_deadline_s)
        self._load = load  # published before the thread runs, so anything it calls sees this step's load
        load.future = self._io.submit(self._run_load, load, list(meta.loads))

    def forward_begins(self, meta: KVStoreConnectorMetadata) -> None:
        """The step's metadata is bound: its forward starts now (vLLM calls ``start_load_kv`` only after the
        forward when nothing loads synchronously, so the forward is timed from here to ``wait_for_save``)."""
        loads = bool(meta.loads or meta.async_loads)
        self._forward = None if loads else (time.monotonic(), meta.scheduled_tokens)

    def _new_load(self, transfers: list[BlockTransfer], worth_s: float | None = None) -> _StepLoad:
        """A load of ``transfers`` with its deadline: the store's for its bytes, twice (the read, then the copies),
        or ``worth_s`` (when vLLM would have computed them: the scheduler's decision) if sooner."""
        n = sum(len(t.keys) for t in transfers)
        budget = 2 * self.store.load_deadline_s(n * self.layout.bytes_per_block)
        load = _StepLoad(len(self.layer_names), time.monotonic() + (budget if worth_s is None else min(budget, worth_s)),
                         {b for t in transfers for b in t.block_ids[0]})
        load.read_deadline_s = worth_s
        return load

    def _run_load(self, load: _StepLoad, transfers: list[BlockTransfer]) -> None:
        cache = self._cache()
        try:
            keys = [k for t in transfers for k in t.keys]
            groups = len(transfers[0].block_ids)
            block_ids = [[b for t in transfers for b in t.block_ids[g]] for g in range(groups)]
            staging = torch.empty((len(keys), self.layout.bytes_per_block), dtype=torch.uint8)
            t0 = time.perf_counter()
            found = self.store.get(self.shard.keys(keys), list(staging), load.read_deadline_s)
            t1 = time.perf_counter()
            self.load_steps["read"] += t1 - t0
            with load.lock:
                if load.abandoned:
                    return
                load.failed_block_ids = {b for b, f in zip(block_ids[0], found) if not f}
                load.complete = all(found)
            per_layer = staging.view(len(keys), len(self.layer_names), self.page_bytes)
            # per group once (not per layer): the found positions it has a block for, and those blocks
            targets = [[i for i, f in enumerate(found) if f and ids[i] != NULL] for ids in block_ids]
            for layer, group in enumerate(self.layer_groups):
                ok = targets[group]
                with load.lock:  # never a layer after the forward stopped waiting (late bytes are not used)
                    if load.abandoned:
                        return
                    if ok:
                        cache.write(layer, [block_ids[group][i] for i in ok], per_layer[ok, layer])
                        cache.fence()  # the forward may read the layer as soon as the event is set
                load.layer_done[layer].set()
            self.load_steps["write"] += time.perf_counter() - t1
        except BaseException:
            with load.lock:
                load.failed_block_ids = {b for t in transfers for b in t.block_ids[0]}
                load.complete = False
            log.exception("kvstore load failed; %d blocks will be recomputed", len(load.failed_block_ids))
            raise
        finally:
            for ev in load.layer_done:
                ev.set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's loads have reached layer ``layer_name`` (no-op for a layer kvstore does not hold)."""
        layer = self._layer_index.get(layer_name)
        if self._load is not None and layer is not None:
            self._load.wait_layer(layer)

    # ----------------------------------------------------------------- saves
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy layer ``layer_name``'s slice of the blocks this step fills to the host staging buffer."""
        layer = self._layer_index.get(layer_name)
        if layer is None or self._save_staging is None:
            return
        self._stage(layer)

    def _stage(self, layer: int) -> None:
        assert self._save_staging is not None
        ids = [b for s in self._saves for b in s.block_ids[self.layer_groups[layer]]]
        self._save_staging[:, layer].copy_(self._cache().read(layer, ids))
        self._staged[layer] = True

    def wait_for_save(self) -> None:
        """Hand the staged blocks to the background writer (stored blocks never change) and return at once."""
        if self._forward is not None:
            t0, tokens = self._forward
            self.forward_time[0] += tokens
            self.forward_time[1] += time.monotonic() - t0
            self._forward = None
        if self._load is not None:
            self._finish_load()
        if self._save_staging is None:
            return
        for layer, staged in enumerate(self._staged):
            if not staged:  # a layer whose attention did not call save_kv_layer: its KV is complete now
                self._stage(layer)
        keys = [k for s in self._saves for k in s.keys]
        blocks = self._save_staging.view(len(keys), -1)  # this step's own buffer: the queue owns it from here
        self.save_queue.submit(self.shard.keys(keys), blocks)
        self._saves, self._save_staging = [], None

    def _finish_load(self) -> None:
        load, self._load = self._load, None
        assert load is not None
        try:
            load.wait()
        except Exception:  # already logged; its blocks are in failed_block_ids
            pass
        self._load_errors |= load.failed_block_ids

    # -------------------------------------------------------------- results
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing is asynchronous across steps: no request is ever still sending or receiving."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks this step's loads could not fill (then cleared)."""
        if self._load is not None:
            self._finish_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """``(done, failed)`` request ids of the asynchronous loads since the last call (failed ones are in both,
        as vLLM wants them)."""
        done, failed = self._loads_done, self._loads_failed
        self._loads_done, self._loads_failed = set(), set()
        return done, failed

    def shutdown(self) -> None:
        self._io.shutdown(wait=True)
        self.save_queue.close()
        self.store.close()

