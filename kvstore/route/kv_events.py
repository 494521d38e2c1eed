"""KV events in vLLM's exact msgpack shape (``vllm/distributed/kv_events.py``), so one router reads both.

A batch is an array ``[ts, events, data_parallel_rank]``; each event is a map
tagged by its class name (``{"type": "BlockStored", ...}``), as msgspec
encodes vLLM's structs. Fields vLLM adds later are ignored on decode; fields
kvstore does not use keep vLLM's defaults.

The tier travels in vLLM's ``medium``. kvstore publishes vLLM's names where
vLLM has one (``GPU``, ``CPU`` for the host tier, ``STORAGE`` for the disk
tier) and ``REMOTE`` for the shared remote tier, so a consumer written for
vLLM understands kvstore's events. :func:`tier_of` maps a medium back to
kvstore's tier names (``gpu``/``host``/``disk``/``remote``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

RouteTier = Literal["gpu", "host", "disk", "remote"]
"""Where a replica holds a block, as the router sees it."""

ROUTE_TIERS: tuple[RouteTier, ...] = ("gpu", "host", "disk", "remote")
"""Fastest first."""

_MEDIUM_OF: dict[str, str] = {"gpu": "GPU", "host": "CPU", "disk": "STORAGE", "remote": "REMOTE"}
_TIER_OF: dict[str, RouteTier] = {
    "GPU": "gpu", "CPU": "host", "STORAGE": "disk", "REMOTE": "remote",
    "gpu": "gpu", "host": "host", "cpu": "host", "disk": "disk", "storage": "disk", "remote": "remote",
}


class EventFormatError(ValueError):
    """Bytes that are not a KV event batch (malformed msgpack, wrong types, unknown event tag, unknown medium)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``EventBatch``: when it was published, its events, and the sender's data-parallel rank."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; msgspec tags each with its class name, as vLLM's do."""


class BlockStored(KVCacheEvent):
    """Blocks now held in ``medium``. kvstore's keys are 32-byte ``bytes``; vLLM's are ``bytes`` or ``int``."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer held in ``medium``; ``None`` (kvstore: dropped from the index) means every tier."""

    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The sender holds nothing any more (a restart, a reset of its cache)."""


class KVEventBatch(EventBatch):
    """vLLM's ``KVEventBatch``: an :class:`EventBatch` whose events are the three kinds above."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def medium_of(tier: str) -> str:
    """The vLLM ``medium`` kvstore publishes for its tier ``tier`` (``gpu``/``host``/``disk``/``remote``)."""
    try:
        return _MEDIUM_OF[tier]
    except KeyError:
        raise ValueError(f"no medium for tier {tier!r}; tiers are {', '.join(_MEDIUM_OF)}") from None


def tier_of(medium: str | None) -> RouteTier:
    """kvstore's tier for a published ``medium``; ``None`` is ``gpu`` (vLLM before it named mediums).

    Raises :class:`EventFormatError` naming an unknown medium.
    """
    if medium is None:
        return "gpu"
    try:
        return _TIER_OF[medium]
    except KeyError:
        raise EventFormatError(f"unknown medium {medium!r}; known: GPU, CPU, STORAGE, REMOTE") from None


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack bytes of ``batch``, byte-identical to what vLLM's publisher sends for the same batch."""
    return _encoder.encode(batch)


def decode_batch(data: bytes | memoryview) -> KVEventBatch:
    """Decode one published batch; :class:`EventFormatError` says what was wrong (never another exception)."""
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise EventFormatError(f"not a KV event batch: {exc}") from None
    except msgspec.DecodeError as exc:
        raise EventFormatError(f"malformed msgpack: {exc}") from None
