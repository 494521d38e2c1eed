"""The router's vLLM block keys (kvstore/route/vllm_keys.py) are vLLM's own: chains from vLLM's request block
hasher (extra keys, cache_salt, PYTHONHASHSEED seed) and its KV-event int form, and the known answers the main
suite checks (tests/route/vllm_known_hashes.json) are what vLLM computes; the router's index, fed the events
vLLM's own BlockPool queues, matches the router's keys."""

from __future__ import annotations

from needs_vllm import require_vllm

require_vllm()

# ruff: noqa: E402 - the imports below need vLLM
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from vllm.distributed import kv_events as vk
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256, sha256_cbor
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import Request

from kvstore.route.index import PrefixHit, RouterIndex
from kvstore.route.kv_events import decode_batch
from kvstore.route.vllm_keys import VllmKeyScheme

KNOWN = json.loads((Path(__file__).parent.parent / "route" / "vllm_known_hashes.json").read_text())["cases"]


@pytest.fixture
def none_hash_restored() -> Iterator[None]:
    """vLLM's NONE_HASH is a module global (other tests' harness may have set it): put it back afterwards."""
    saved = ku.__dict__.get("NONE_HASH"), ku._NONE_HASH_SEED
    yield
    if saved[0] is None:
        del ku.NONE_HASH
    else:
        ku.NONE_HASH = saved[0]
    ku._NONE_HASH_SEED = saved[1]


def _vllm_hashes(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The block hashes vLLM's own request block hasher gives ``case``'s prompt, seeded as ``case`` says."""
    if case["hash_seed"] is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", case["hash_seed"])
    ku.init_none_hash(sha256)
    request = Request(request_id=case["name"], prompt_token_ids=list(case["token_ids"]),
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                      cache_salt=case["cache_salt"],
                      block_hasher=ku.get_request_block_hasher(case["block_size"], sha256))
    return list(request.block_hashes)


@pytest.mark.parametrize("case", KNOWN, ids=[c["name"] for c in KNOWN])
def test_known_answers_are_what_vllm_computes(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                              none_hash_restored: None) -> None:
    hashes = _vllm_hashes(case, monkeypatch)
    assert [h.hex() for h in hashes] == case["digests"]
    scheme = VllmKeyScheme(case["block_size"], case["hash_seed"])
    assert scheme.block_hashes(case["token_ids"], case["cache_salt"]) == hashes
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    assert [ku.maybe_convert_block_hash(h) for h in hashes] == case["ints"] == scheme.keys(case["token_ids"],
                                                                                         case["cache_salt"])
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert [ku.maybe_convert_block_hash(h) for h in hashes] == hashes == \
        VllmKeyScheme(case["block_size"], case["hash_seed"], int_hashes=False).keys(case["token_ids"],
                                                                                   case["cache_salt"])


@pytest.mark.parametrize(("block_size", "seed", "salt"), [(16, None, None), (16, None, "s"), (32, "0", None),
                                                          (4, "a seed", "tenant")])
def test_long_chains_match_vllms_hash_block_tokens(block_size: int, seed: str | None, salt: str | None,
                                                   monkeypatch: pytest.MonkeyPatch, none_hash_restored: None) -> None:
    tokens = [(i * 7919) % 151_000 for i in range(block_size * 12 + 3)]  # 12 full blocks and a partial one
    case = {"name": "chain", "token_ids": tokens, "block_size": block_size, "hash_seed": seed, "cache_salt": salt}
    expected = _vllm_hashes(case, monkeypatch)
    # the same chain by hand from vLLM's primitive: the salt only in the first block's extra keys
    parent = None
    by_hand = []
    for i in range(12):
        extra = (("cache_salt", salt),) if i == 0 and salt else None
        parent = ku.hash_block_tokens(sha256, parent, tokens[i * block_size:(i + 1) * block_size], extra)
        by_hand.append(parent)
    assert len(expected) == 12 and by_hand == expected
    assert VllmKeyScheme(block_size, seed).block_hashes(tokens, salt) == expected


@pytest.mark.parametrize(("int_hashes", "salt"), [(True, None), (False, None), (True, "tenant")])
def test_the_router_matches_the_events_vllms_block_pool_publishes(int_hashes: bool, salt: str | None,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  none_hash_restored: None) -> None:
    """vLLM's BlockPool caches a request's full blocks and queues BlockStored; its bytes (vLLM's encoder), decoded
    and applied by the router's index, hold exactly the prefix the router's keys look up."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if int_hashes else "0")
    prompt = [(i * 31) % 997 for i in range(16 * 5 + 7)]  # 5 full blocks
    case = {"name": "pool", "token_ids": prompt, "block_size": 16, "hash_seed": None, "cache_salt": salt}
    _vllm_hashes(case, monkeypatch)  # seeds vLLM's NONE_HASH as a replica would
    request = Request(request_id="r", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1),
                      pooling_params=None, cache_salt=salt, block_hasher=ku.get_request_block_hasher(16, sha256))
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(request, blocks, num_cached_blocks=0, num_full_blocks=3, block_size=16,
                           kv_cache_group_id=0)
    data = msgspec.msgpack.Encoder().encode(vk.KVEventBatch(ts=1.0, events=pool.take_events()))
    index = RouterIndex()
    index.add_replica("other")
    index.apply("vllm-0", decode_batch(data))
    keys = VllmKeyScheme(16, int_hashes=int_hashes).keys(prompt, salt)
    assert len(keys) == 5 and all(isinstance(k, int if int_hashes else bytes) for k in keys)
    assert index.cached_prefix(keys) == {"vllm-0": PrefixHit(3, {"gpu": 3}), "other": PrefixHit(0, {})}


def test_sha256_cbor_chains_match_vllms_where_cbor2_is_installed(monkeypatch: pytest.MonkeyPatch,
                                                                 none_hash_restored: None) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    ku.init_none_hash(sha256_cbor)
    tokens = list(range(50))
    request = Request(request_id="cbor", prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                      pooling_params=None, cache_salt="s", block_hasher=ku.get_request_block_hasher(16, sha256_cbor))
    assert len(request.block_hashes) == 3
    assert VllmKeyScheme(16, algo="sha256_cbor").block_hashes(tokens, "s") == list(request.block_hashes)
