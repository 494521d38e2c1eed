"""What kvstore's full vLLM connector sends from its scheduler side to its workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


NULL = -1
"""A group's block id where a position has no block in that group (a sliding window's positions before the
window get vLLM's null block, which nothing reads): nothing is written there."""


@dataclass(frozen=True)
class BlockTransfer:
    """Copy whole vLLM blocks of one request between the paged KV cache and kvstore.

    ``keys[i]`` is kvstore's block of position ``i`` of the transfer; ``block_ids[g][i]`` that position's
    block in KV cache group ``g`` (one group but for hybrid models; :data:`NULL` where the group has none)."""

    req_id: str
    block_ids: tuple[tuple[int, ...], ...]
    keys: tuple[bytes, ...]

    def __post_init__(self) -> None:
        bad = [len(g) for g in self.block_ids if len(g) != len(self.keys)]
        if not self.block_ids or bad:
            raise ValueError(f"request {self.req_id}: {len(self.keys)} keys but block ids per group "
                             f"{[len(g) for g in self.block_ids]}")


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's transfers: loads finish layer by layer before each layer runs, saves after the forward."""

    loads: list[BlockTransfer] = field(default_factory=list)
    """Loaded before the forward reads them (the request is scheduled in this step)."""
    saves: list[BlockTransfer] = field(default_factory=list)
    async_loads: list[BlockTransfer] = field(default_factory=list)
    """Loads of requests waiting in ``WAITING_FOR_REMOTE_KVS`` (hybrid models: vLLM takes a failed load of
    several KV cache groups only as a whole request's, reported from ``get_transfer_results``)."""
    load_deadline_s: float | None = None
    """The longest this step's loads are worth waiting for: by then vLLM would have computed them (the scheduler's
    load decisions, :mod:`kvstore.store.load_cost`); ``None``: only the store's own deadline."""
    scheduled_tokens: int = 0
    """Tokens the step computes: with the forward's time (measured by the workers) the engine's prefill rate."""
