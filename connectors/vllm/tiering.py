"""kvstore as a secondary tier of vLLM's OffloadingConnector (tiering spec).

vLLM keeps GPU <-> CPU; below its CPU (primary) tier, this tier stores each
CPU chunk as one kvstore block, in kvstore's tiers in this process
(``connector: embedded`` in the kvstore config) or in a ``kvstore serve``
daemon (``connector: sidecar``). Configured in ``kv_connector_extra_config``::

    "secondary_tiers": [{"type": "KVStoreSecondaryTier",
                         "module_path": "connectors.vllm.tiering",
                         "kvstore_config": "/path/kvstore.yaml"}]

Keys: vLLM names a chunk by its block hash (an ``OffloadKey``); kvstore
names it by the tokens up to the chunk's end, with kvstore's rules
(:mod:`connectors.engine_keys`). The tier learns each request's tokens from
:class:`~connectors.vllm.offloading.KVStoreOffloadingConnector`, which hands
the request to :attr:`KVStoreSecondaryTier.prompts` before vLLM announces it,
and the chunk's end from the position vLLM records per key
(``ReqContext.get_offload_key_position``). One kvstore block is one vLLM
chunk: the layout's ``block_size`` is vLLM's tokens per chunk (GPU block size
times ``blocks_per_chunk``) and its byte size is the CPU chunk's.

Jobs run on one background thread; ``get_finished_jobs`` reports them. A
load whose block is missing or corrupt (kvstore deletes a block failing its
checksum) fails, and vLLM recomputes those tokens.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from connectors.engine_keys import PromptKeys, engine_layout
from connectors.engine_store import EngineBlockStore, load_store_config
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class _Prompt:
    """What the tier keeps per request (in its ``ReqContext``): the live token list and its key chain."""

    tokens: Any
    """``Request.all_token_ids``: vLLM appends output tokens to it; it never changes what it held."""
    chain: PromptKeys


@dataclass(frozen=True)
class _Outcome:
    """How a job ended: what :class:`JobResult` reports."""

    ok: bool
    nbytes: int
    loaded_keys: list[OffloadKey] | None = None
    """For a load that failed in part, the vLLM keys that did load (``None``: all share ``ok``)."""


class PromptRegistry:
    """Requests handed over by the connector until the tier's ``on_new_request`` takes them. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, Request] = {}

    def offer(self, request: Request) -> None:
        """Make ``request``'s tokens and cache salt known for its next ``on_new_request``."""
        with self._lock:
            self._requests[request.request_id] = request

    def take(self, req_id: str) -> Request | None:
        """Remove and return the offered request ``req_id`` (``None`` if none was offered)."""
        with self._lock:
            return self._requests.pop(req_id, None)


class KVStoreSecondaryTier(SecondaryTierManager):
    """A vLLM secondary tier whose chunks live in kvstore (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        kvstore_config: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
        **unknown: Any,
    ) -> None:
        """``kvstore_config``: path of a kvstore YAML config (its ``connector``, ``tiers``, ``host``, ``disk``,
        ``daemon`` sections); ``None`` uses kvstore's defaults (embedded host + LMDB tiers)."""
        if unknown:
            raise ValueError(f"secondary tier {tier_type!r} (KVStoreSecondaryTier): unknown option(s) "
                             f"{sorted(unknown)}; it takes 'kvstore_config'")
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.layout = chunk_layout(offloading_spec, self.block_size_bytes)
        self.store = EngineBlockStore.open(load_store_config(kvstore_config), self.layout,
                                           client_name=f"vllm secondary tier {tier_type}")
        self.prompts = PromptRegistry()
        """Where :class:`~connectors.vllm.offloading.KVStoreOffloadingConnector` hands over requests."""
        num_chunks = len(primary_kv_view)
        self._primary = torch.frombuffer(primary_kv_view.cast("B"), dtype=torch.uint8).view(num_chunks, -1)
        self._jobs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-vllm-tier")
        self._done_lock = threading.Lock()  # guards _inflight and _done (the job thread finishes jobs)
        self._inflight: set[Future[None]] = set()
        self._done: list[JobResult] = []
        self._warned_untracked = False

    # ------------------------------------------------------------- requests
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        request = self.prompts.take(req_context.req_id)
        if request is not None:
            chain = PromptKeys(self.layout, self.store.salt(request.cache_salt))
            req_context.set_state(_Prompt(request.all_token_ids, chain))
        return RequestOffloadingContext()

    def kvstore_key(self, key: OffloadKey, req_context: ReqContext) -> bytes | None:
        """The kvstore key of vLLM chunk ``key`` in this request, ``None`` if it has none. Pure but for hashing once.

        ``None`` when the request's tokens were not handed over (the connector is not
        :class:`~connectors.vllm.offloading.KVStoreOffloadingConnector`) or the key does not end
        on a chunk boundary.
        """
        prompt = req_context.get_state(_Prompt)
        end = req_context.get_offload_key_position(key)
        if prompt is None:
            if not self._warned_untracked:
                self._warned_untracked = True
                log.warning("KVStoreSecondaryTier: request %s has no token ids (use kv_connector "
                            "KVStoreOffloadingConnector from connectors.vllm.offloading); its chunks "
                            "are neither looked up nor stored", req_context.req_id)
            return None
        if end is None or end % self.layout.block_size or end > len(prompt.tokens):
            return None
        return prompt.chain.key(prompt.tokens, end // self.layout.block_size)

    # --------------------------------------------------------------- lookup
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        kv_key = self.kvstore_key(key, req_context)
        return LookupResult.HIT if kv_key is not None and self.store.contains(kv_key) else LookupResult.MISS

    # ----------------------------------------------------------------- jobs
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = [self.kvstore_key(k, job_metadata.req_context) for k in job_metadata.keys]
        chunks = [int(c) for c in job_metadata.chunk_ids]
        self._submit(job_metadata.job_id, lambda: self._store(keys, chunks))

    def submit_load(self, job_metadata: TransferJob) -> None:
        vllm_keys = list(job_metadata.keys)
        keys = [self.kvstore_key(k, job_metadata.req_context) for k in vllm_keys]
        chunks = [int(c) for c in job_metadata.chunk_ids]
        self._submit(job_metadata.job_id, lambda: self._load(vllm_keys, keys, chunks))

    def _store(self, keys: list[bytes | None], chunks: list[int]) -> _Outcome:
        """Copy primary chunks into kvstore. A chunk without a kvstore key is not stored (the job fails)."""
        pairs = [(k, c) for k, c in zip(keys, chunks) if k is not None]
        stored = self.store.put([k for k, _ in pairs], [self._primary[c] for _, c in pairs])
        return _Outcome(len(pairs) == len(keys) and all(stored), sum(stored) * self.block_size_bytes)

    def _load(self, vllm_keys: list[OffloadKey], keys: list[bytes | None], chunks: list[int]) -> _Outcome:
        """Copy kvstore blocks into primary chunks; a missing or corrupt block fails the job (the others load)."""
        todo = [i for i, k in enumerate(keys) if k is not None]
        got = self.store.get([keys[i] for i in todo], [self._primary[chunks[i]] for i in todo])  # type: ignore[misc]
        loaded = [vllm_keys[i] for i, ok in zip(todo, got) if ok]
        ok = len(loaded) == len(keys)
        return _Outcome(ok, len(loaded) * self.block_size_bytes, None if ok else loaded)

    def _submit(self, job_id: int, work: Callable[[], _Outcome]) -> None:
        def run() -> None:
            try:
                out = work()
            except Exception:  # a failed job is reported as failed; vLLM recomputes or skips the chunks
                log.exception("KVStoreSecondaryTier job %d failed", job_id)
                out = _Outcome(False, 0, [])
            with self._done_lock:
                self._done.append(JobResult(job_id=job_id, success=out.ok, successful_keys=out.loaded_keys,
                                            transfer_bytes=out.nbytes))
                self._inflight.discard(fut)

        with self._done_lock:  # held so that run() cannot discard fut before it is added
            fut = self._jobs.submit(run)
            self._inflight.add(fut)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._done_lock:
            done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        with self._done_lock:
            return bool(self._inflight)

    def drain_jobs(self) -> None:
        with self._done_lock:
            pending = list(self._inflight)
        wait(pending)

    def shutdown(self) -> None:
        self._jobs.shutdown(wait=True)
        self.store.close()


def chunk_layout(spec: OffloadingSpec, chunk_bytes: int) -> KVLayout:
    """The kvstore layout of one vLLM CPU chunk of ``spec``'s model (single KV cache group only).

    Raises ``ValueError`` for a model with several KV cache groups (hybrid attention), whose
    chunks this tier does not key.
    """
    cfg = spec.config
    if len(cfg.groups) != 1:
        raise ValueError(f"KVStoreSecondaryTier supports models with one KV cache group; "
                         f"{cfg.model.name} has {len(cfg.groups)}")
    tokens = cfg.groups[0].tokens_per_block * cfg.cache.blocks_per_chunk
    p = cfg.parallel
    byte_format = (f"layout={cfg.kv_cache_layout}|canonical={cfg.canonical_layout}|tp={p.tp_size}|pp={p.pp_size}"
                   f"|pcp={p.pcp_size}|dcp={p.dcp_size}|replicated={cfg.replicated_layout}")
    return engine_layout("vllm", cfg.model.name, cfg.model.dtype, tokens, chunk_bytes, byte_format)
