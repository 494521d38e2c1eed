"""vLLM's real Scheduler with kvstore's full connector, and that connector's real worker side on CPU tensors.

:class:`FullRig` plays the model runner: each step it binds the scheduler's
connector metadata to a worker-role :class:`KVStoreConnector` over CPU KV
tensors (``[2, num_blocks, block_size, heads, head_dim]`` per layer, the
flash-attention shape), calls ``start_load_kv``, then per layer
``wait_for_layer_load``, "computes" the scheduled tokens' KV (a pattern
derived from the prefix and the layer, :func:`layer_kv`), ``save_kv_layer``,
and at the end ``wait_for_save`` and ``get_block_ids_with_load_errors``,
whose result goes back to the scheduler as ``invalid_block_ids``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import yaml
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

import harness as h
from connectors.vllm.connector import KVStoreConnector
from offload_worker import kv_bytes

NUM_GPU_BLOCKS = 64


def full_connector(config: Path) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of adapter (2), as the README gives it."""
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "connectors.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kvstore_config": str(config)}}


def sidecar_config(root: Path, socket_path: str) -> Path:
    """A kvstore config pointing at the daemon at ``socket_path``."""
    path = root / "engine.yaml"
    path.write_text(yaml.safe_dump({"connector": "sidecar", "daemon": {"socket_path": socket_path}}))
    return path


def layer_kv(prefix: list[int], layer: int) -> torch.Tensor:
    """The bytes of one block of one layer whose tokens end ``prefix``: ``[2, block, heads, 2 * head_dim]`` uint8."""
    shape = (2, h.BLOCK_SIZE, h.NUM_KV_HEADS, 2 * h.HEAD_DIM)
    return kv_bytes(prefix + [-1 - layer], 2 * h.BLOCK_SIZE * h.NUM_KV_HEADS * h.HEAD_DIM * 2).view(shape)


class FullRig:
    """Scheduler + worker-side connector, stepping like a model runner would (see the module docstring)."""

    def __init__(self, model: Path, config: Path) -> None:
        self.config = h.vllm_config(model, full_connector(config), num_gpu_blocks=NUM_GPU_BLOCKS)
        self.scheduler = h.make_scheduler(self.config, NUM_GPU_BLOCKS)
        kv_cache_config = self.scheduler.kv_cache_config
        self.layers = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self.worker = KVStoreConnector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        self.kv = {name: torch.zeros((2, NUM_GPU_BLOCKS, h.BLOCK_SIZE, h.NUM_KV_HEADS, h.HEAD_DIM),
                                     dtype=torch.float16) for name in self.layers}
        self.worker.register_kv_caches(self.kv)
        self.load_errors: list[set[int]] = []

    def block_bytes(self, layer: int, block_id: int) -> torch.Tensor:
        return self.kv[self.layers[layer]].view(torch.uint8)[:, block_id]

    def step(self) -> Any:
        out = self.scheduler.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]  # the connector does not read the forward context
        for layer, name in enumerate(self.layers):
            self.worker.wait_for_layer_load(name)
            self._compute(out, layer)
            self.worker.save_kv_layer(name, self.kv[name], None)  # type: ignore[arg-type]
        self.worker.wait_for_save()  # hands the step's saves to the background writer
        assert self.worker.connector_worker.save_queue.wait_idle(30)  # the next step's lookups see them (a real engine may not)
        errors = self.worker.get_block_ids_with_load_errors()
        self.load_errors.append(errors)
        sending, recving = self.worker.get_finished(set())
        self.worker.clear_connector_metadata()
        self.scheduler.update_from_output(out, h.runner_output(out, finished_sending=sending or (),
                                                               finished_recving=recving or (),
                                                               invalid_block_ids=errors))
        return out

    def _compute(self, out: Any, layer: int) -> None:
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            end = req.num_computed_tokens  # schedule() advanced it past this step's tokens
            for i in range((end - n) // h.BLOCK_SIZE, end // h.BLOCK_SIZE):
                self.block_bytes(layer, blocks[i])[:] = layer_kv(list(req.all_token_ids[: (i + 1) * h.BLOCK_SIZE]), layer)

    def run(self, req_id: str, max_steps: int = 50) -> list[Any]:
        """Step until ``req_id`` has finished; returns each step's scheduler output. A step that schedules nothing
        (the request waits for its lookup: the connector answered vLLM "not yet") is not counted: those are
        polled by time, since how many it takes depends on the machine's load."""
        outs: list[Any] = []
        steps, deadline = 0, time.monotonic() + 60.0
        while steps < max_steps and time.monotonic() < deadline:
            outs.append(self.step())
            if req_id not in self.scheduler.requests:
                return outs
            if outs[-1].num_scheduled_tokens:
                steps += 1
            else:
                time.sleep(0.005)
        raise AssertionError(f"request {req_id} did not finish in {max_steps} steps")

    def first_step(self, req_id: str) -> Any:
        """The first step that schedules ``req_id`` (after any waiting for its lookup, see :meth:`run`)."""
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            out = self.step()
            if req_id in out.num_scheduled_tokens:
                return out
            assert not out.num_scheduled_tokens, f"another request was scheduled: {out.num_scheduled_tokens}"
            time.sleep(0.005)
        raise AssertionError(f"request {req_id} was never scheduled")

    def blocks_hold(self, req_id: str, tokens: list[int], n_blocks: int) -> bool:
        """Whether ``req_id``'s first ``n_blocks`` GPU blocks hold ``tokens``' KV in every layer."""
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        return all(torch.equal(self.block_bytes(layer, blocks[i]), layer_kv(tokens[: (i + 1) * h.BLOCK_SIZE], layer))
                   for layer in range(len(self.layers)) for i in range(n_blocks))

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
