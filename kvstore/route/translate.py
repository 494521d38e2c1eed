"""kvstore's store events (:mod:`kvstore.events`) as vLLM-shaped KV events, and a store's full report.

``stored`` / ``spilled`` / ``loaded`` put a block in a tier (``BlockStored``
with that tier's medium); ``evicted`` / ``corrupt`` take it out of one tier
(``BlockRemoved`` for that tier); ``dropped`` takes it out of the index
entirely (``BlockRemoved`` with medium ``None``: every tier). Consecutive
events of one kind and tier share one event, so order is kept.
kvstore's events carry no tokens or parent key, so ``token_ids`` is empty
and ``parent_block_hash`` ``None`` (the router needs only the keys).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.events import StoreEvent
from kvstore.route.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch, medium_of

if TYPE_CHECKING:
    from kvstore.store.tiered import TieredStore

_ADDS = frozenset({"stored", "spilled", "loaded"})
_REMOVES = frozenset({"evicted", "corrupt"})


def kv_events(events: Sequence[StoreEvent], block_size: int) -> list[KVEvent]:
    """The KV events for ``events`` (oldest first), consecutive ones of one kind and tier merged.

    Raises ``ValueError`` naming an event of unknown kind or tier (a bug in the store, not input).
    """
    out: list[KVEvent] = []
    run: tuple[str, str | None] | None = None
    for ev in events:
        if ev.kind in _ADDS:
            this: tuple[str, str | None] = ("stored", medium_of(ev.tier))
        elif ev.kind in _REMOVES:
            this = ("removed", medium_of(ev.tier))
        elif ev.kind == "dropped":
            this = ("removed", None)
        else:
            raise ValueError(f"store event of unknown kind {ev.kind!r} for block {ev.key.hex()[:16]}")
        if this == run:
            out[-1].block_hashes.append(ev.key)  # type: ignore[union-attr]
            continue
        run = this
        if this[0] == "stored":
            out.append(BlockStored(block_hashes=[ev.key], parent_block_hash=None, token_ids=[],
                                   block_size=block_size, lora_id=None, medium=this[1], lora_name=None))
        else:
            out.append(BlockRemoved(block_hashes=[ev.key], medium=this[1]))
    return out


def batch_of(events: Sequence[KVEvent], ts: float | None = None) -> KVEventBatch:
    """A batch of ``events`` stamped ``ts`` (default: now, as vLLM stamps its batches)."""
    return KVEventBatch(ts=time.time() if ts is None else ts, events=list(events))


def report_events(held: dict[str, list[bytes]], block_size: int) -> list[KVEvent]:
    """A full report: all-cleared, then one ``BlockStored`` per tier of ``held`` (tier -> keys)."""
    out: list[KVEvent] = [AllBlocksCleared()]
    for tier, keys in held.items():
        if keys:
            out.append(BlockStored(block_hashes=list(keys), parent_block_hash=None, token_ids=[],
                                   block_size=block_size, lora_id=None, medium=medium_of(tier), lora_name=None))
    return out


def store_holdings(store: TieredStore) -> dict[str, list[bytes]]:
    """Every block ``store``'s index holds, per tier (a block in two tiers is listed in both). Takes the lock.

    The remote tier is not indexed by the store (its copies are found by probing), so it is not listed.
    """
    out: dict[str, list[bytes]] = {"gpu": [], "host": [], "disk": []}
    with store.lock:
        for node in store.index.nodes():
            for e in node.entries:
                if e.gpu_block is not None:
                    out["gpu"].append(e.key)
                if e.host_slot is not None:
                    out["host"].append(e.key)
                if e.on_disk:
                    out["disk"].append(e.key)
    return out
