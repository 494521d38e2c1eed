"""What kvstore's full vLLM connector sends from its scheduler side to its workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class BlockTransfer:
    """Copy whole vLLM blocks of one request between the paged KV cache and kvstore: ``block_ids[i]`` <-> ``keys[i]``."""

    req_id: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.keys):
            raise ValueError(f"request {self.req_id}: {len(self.block_ids)} block ids but {len(self.keys)} keys")


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's transfers: loads finish layer by layer before each layer runs, saves after the forward."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
