"""The router's vLLM block keys (kvstore/route/vllm_keys.py) are vLLM's own: chains from vLLM's request block
hasher (extra keys, cache_salt, PYTHONHASHSEED seed) and its KV-event int form, and the known answers the main
suite checks (tests/route/vllm_known_hashes.json) are what vLLM computes."""

from __future__ import annotations

from needs_vllm import require_vllm

require_vllm()

# ruff: noqa: E402 - the imports below need vLLM
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.request import Request

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
