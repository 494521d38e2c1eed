"""A stand-in for the OffloadingConnector's worker side: GPU blocks and copies as bytes, no GPU.

:class:`FakeOffloadWorker` plays the model runner for an OffloadingConnector
scheduler. Each GPU block's "KV" is a byte pattern derived from the tokens up
to the block's end (:func:`kv_bytes`), so a block that went GPU -> CPU chunk
-> kvstore -> CPU chunk -> GPU can be checked bit for bit. Store and load
jobs copy between its GPU blocks and vLLM's real CPU (primary) tier memory,
and are reported complete the way the real worker does
(``OffloadingWorkerMetadata``, ``finished_recving``).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata, OffloadingWorkerMetadata,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from harness import BLOCK_SIZE, runner_output


def kv_bytes(prefix: list[int], nbytes: int) -> torch.Tensor:
    """The KV bytes of the block ending ``prefix`` (content-addressed, like real KV)."""
    seed = hashlib.blake2b(repr(prefix).encode(), digest_size=32).digest()
    return torch.frombuffer(bytearray(seed * (nbytes // 32 + 1))[:nbytes], dtype=torch.uint8).clone()


class FakeOffloadWorker:
    """Runs a scheduler's steps with copies between fake GPU blocks and vLLM's CPU tier memory."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        connector: Any = scheduler.connector
        manager = connector.scheduler.manager
        view = manager.primary_tier.get_kv_memoryview()
        self.primary = torch.frombuffer(view.cast("B"), dtype=torch.uint8).view(len(view), -1)
        self.gpu: dict[int, torch.Tensor] = {}
        self.loaded: dict[str, list[torch.Tensor]] = {}
        """Per request, the bytes each loaded GPU block received, in load order."""

    # ------------------------------------------------------------------ steps
    def step(self, invalid_block_ids: set[int] | None = None) -> Any:
        """One scheduler step: schedule, "compute" the scheduled tokens, run the transfer jobs, report them."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        done = OffloadingWorkerMetadata()
        recving: set[str] = set()
        for job_id, job in meta.load_jobs.items():
            for chunk, block in zip(job.src_spec.block_ids, job.dst_spec.block_ids):
                self.gpu[int(block)] = self.primary[int(chunk)].clone()
                self.loaded.setdefault(job.req_id, []).append(self.gpu[int(block)])
            done.mark_completed(job_id)
            recving.add(job.req_id)
        self._compute(out)
        for job_id, job in meta.store_jobs.items():
            for block, chunk in zip(job.src_spec.block_ids, job.dst_spec.block_ids):
                self.primary[int(chunk)] = self.gpu[int(block)]
            done.mark_completed(job_id)
        result: ModelRunnerOutput = runner_output(out, finished_recving=recving,
                                                  invalid_block_ids=invalid_block_ids or ())
        result.kv_connector_output.kv_connector_worker_meta = done  # type: ignore[union-attr]
        self.scheduler.update_from_output(out, result)
        return out

    def _compute(self, out: Any) -> None:
        """Write the KV of every full block a scheduled request computed this step."""
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            end = req.num_computed_tokens  # schedule() already advanced it past this step's tokens
            for i in range((end - n) // BLOCK_SIZE, end // BLOCK_SIZE):
                self.gpu[blocks[i]] = kv_bytes(list(req.all_token_ids[: (i + 1) * BLOCK_SIZE]), self.primary.shape[1])

    def run(self, req_id: str, max_steps: int = 200) -> list[Any]:
        """Step until request ``req_id`` finished and the connector has no transfer pending; returns the steps' outputs."""
        outs = []
        steps = 0
        deadline = time.monotonic() + 60.0
        while steps < max_steps and time.monotonic() < deadline:
            outs.append(self.step())
            req = self.scheduler.requests.get(req_id)
            finished = req is None or req.status == RequestStatus.FINISHED_LENGTH_CAPPED
            if finished and not self._pending():
                return outs
            if finished or not outs[-1].num_scheduled_tokens:
                # Only the tier's transfer jobs are left, or the request waits for a lookup or load running
                # on the tier's own thread: poll for them by time rather than by steps (how many empty steps
                # they take depends on the machine's load).
                time.sleep(0.005)
            else:
                steps += 1
        req = self.scheduler.requests.get(req_id)
        raise AssertionError(f"request {req_id} did not finish in {max_steps} steps (or its transfers in 60 s): "
                             f"status {req.status if req else None}, connector pending {self._pending()}")

    def _pending(self) -> bool:
        """Whether the connector still wants steps (vLLM's own answer: jobs in flight, cascades, tier work)."""
        connector: Any = self.scheduler.connector
        return bool(connector.has_pending_push_work())

    def loaded_kv_is(self, req_id: str, tokens: list[int]) -> bool:
        """Whether the blocks loaded for ``req_id`` hold, in order, the KV of ``tokens``' first blocks."""
        got = self.loaded.get(req_id, [])
        return bool(got) and all(torch.equal(t, kv_bytes(tokens[: (i + 1) * BLOCK_SIZE], self.primary.shape[1]))
                                 for i, t in enumerate(got))
