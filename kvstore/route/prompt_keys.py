"""A prompt's block keys under every key scheme in the fleet, and what each replica holds of it.

kvstore replicas key blocks by kvstore's chain (:func:`kvstore.hashing.block_keys`, rooted in the
layout they report); a vLLM replica by vLLM's (:class:`~kvstore.route.vllm_keys.VllmKeyScheme`,
from its ``--replica`` spec). Per request the keys are computed once per scheme in use (vLLM
replicas configured alike share one computation), each scheme's keys are looked up in the one
:class:`~kvstore.route.index.RouterIndex`, and a replica takes the result of its own scheme's
lookup only. So hits are in each replica's own blocks; :func:`block_scales` says how big those
are in the unit the policy counts the prompt in::

    token ids --block_keys(layout)-----------> kvstore keys --cached_prefix--> kvstore replicas' hits
              --VllmKeyScheme(16, ...).keys--> vLLM keys    --cached_prefix--> those vLLM replicas' hits
              --VllmKeyScheme(32, ...).keys--> ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.hashing import block_keys
from kvstore.layout import KVLayout
from kvstore.route.index import BlockHash, PrefixHit, RouterIndex
from kvstore.route.replica_set import ReplicaSpec
from kvstore.route.vllm_keys import VllmKeyScheme

DEFAULT_UNIT_TOKENS = 16
"""The policy's block unit while no kvstore replica has reported its layout (kvstore's and vLLM's default)."""

_NO_HIT = PrefixHit(0, {})


@dataclass(frozen=True)
class PromptKeys:
    """One request's token ids and block keys per scheme (built by :func:`prompt_keys`; read-only)."""

    token_ids: list[int]
    kvstore: list[bytes]
    """kvstore's keys (empty while no kvstore replica has reported its layout)."""
    vllm: dict[VllmKeyScheme, list[bytes] | list[int]]
    """vLLM's keys, in each scheme's event form, for every vLLM scheme in the fleet."""
    model: str | None = None
    """The model the request names (a vLLM replica serving another one does not have its keys)."""
    unit_tokens: int = DEFAULT_UNIT_TOKENS
    """Tokens per block of the unit the policy counts the prompt in (the kvstore layout's block size)."""

    def of(self, spec: ReplicaSpec) -> Sequence[BlockHash]:
        """The keys under ``spec``'s scheme; empty when that replica cannot have them (unknown layout, another
        model: a LoRA adapter)."""
        if spec.vllm is None:
            return self.kvstore
        if spec.model is not None and self.model is not None and self.model != spec.model:
            return []
        return self.vllm.get(spec.vllm, [])

    @property
    def unit_blocks(self) -> int:
        """Full unit blocks in the prompt: what the policy counts a replica's misses against. 0 when no scheme
        has keys (no layout yet, no vLLM replica): no replica can have a hit, so the prefix term, the same for
        every replica, is left out."""
        return len(self.token_ids) // self.unit_tokens if self.kvstore or self.vllm else 0


def prompt_keys(token_ids: list[int], specs: Sequence[ReplicaSpec], layout: KVLayout | None,
                cache_salt: str | None = None, model: str | None = None) -> PromptKeys:
    """The keys of ``token_ids`` under every scheme among ``specs`` (kvstore's needs ``layout``). Pure."""
    kvstore: list[bytes] = []
    if layout is not None and any(s.vllm is None for s in specs):
        kvstore = block_keys(token_ids, layout, cache_salt)
    schemes = {s.vllm for s in specs if s.vllm is not None}
    vllm = {scheme: scheme.keys(token_ids, cache_salt) for scheme in schemes}
    return PromptKeys(token_ids, kvstore, vllm, model,
                      DEFAULT_UNIT_TOKENS if layout is None else layout.block_size)


def cached_prefixes(index: RouterIndex, keys: PromptKeys, specs: Sequence[ReplicaSpec]) -> dict[str, PrefixHit]:
    """Every replica in ``specs``' cached prefix of the prompt, in its own blocks: one
    :meth:`RouterIndex.cached_prefix` per scheme, each replica reading its own scheme's. Changes nothing
    (the caller holds the index's lock)."""
    lookups: dict[VllmKeyScheme | None, dict[str, PrefixHit]] = {}  # scheme (None: kvstore's) -> its hits
    hits: dict[str, PrefixHit] = {}
    for spec in specs:
        own = keys.of(spec)
        if not own:
            hits[spec.name] = _NO_HIT
            continue
        if spec.vllm not in lookups:
            lookups[spec.vllm] = index.cached_prefix(own)
        hits[spec.name] = lookups[spec.vllm].get(spec.name, _NO_HIT)
    return hits


def block_scales(keys: PromptKeys, specs: Sequence[ReplicaSpec]) -> Mapping[str, float]:
    """Each replica's block size in the policy's unit (kvstore replicas: 1), for
    :meth:`~kvstore.route.policy.CostPolicy.choose`."""
    return {s.name: 1.0 if s.vllm is None else s.vllm.block_size / keys.unit_tokens for s in specs}
