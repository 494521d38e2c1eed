"""The router's vLLM block keys: known answers (which tests/vllm checks against vLLM itself), event forms, and the
hash settings it refuses, each saying why."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from kvstore.route.vllm_keys import DEFAULT_NONE_HASH_SEED, UnsupportedHashError, VllmKeyScheme, event_form

KNOWN = json.loads((Path(__file__).parent / "vllm_known_hashes.json").read_text())["cases"]


@pytest.mark.parametrize("case", KNOWN, ids=[c["name"] for c in KNOWN])
def test_known_answers(case: dict[str, Any]) -> None:
    scheme = VllmKeyScheme(case["block_size"], case["hash_seed"])
    assert [h.hex() for h in scheme.block_hashes(case["token_ids"], case["cache_salt"])] == case["digests"]
    assert scheme.keys(case["token_ids"], case["cache_salt"]) == case["ints"]
    bytes_form = VllmKeyScheme(case["block_size"], case["hash_seed"], int_hashes=False)
    assert [k.hex() for k in bytes_form.keys(case["token_ids"], case["cache_salt"])] == case["digests"]


def test_the_chain_is_vllms_formula_from_the_seeds_hash() -> None:
    def h(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    tokens = list(range(9))
    first = h((h(DEFAULT_NONE_HASH_SEED), (0, 1, 2, 3), None))
    second = h((first, (4, 5, 6, 7), None))
    assert VllmKeyScheme(4).block_hashes(tokens) == [first, second]  # token 8: a partial block, no key
    salted = h((h("7"), (0, 1, 2, 3), (("cache_salt", "t"),)))
    assert VllmKeyScheme(4, hash_seed="7").block_hashes(tokens, "t") == [salted, h((salted, (4, 5, 6, 7), None))]
    assert event_form(first) == int.from_bytes(first[-8:], "big")
    assert VllmKeyScheme(4).block_hashes([1, 2, 3]) == []


def test_a_salt_or_a_seed_changes_every_key_and_the_salt_only_enters_the_first_block() -> None:
    tokens = list(range(32))
    plain, salted = VllmKeyScheme(8).block_hashes(tokens), VllmKeyScheme(8).block_hashes(tokens, "a")
    seeded = VllmKeyScheme(8, hash_seed="0").block_hashes(tokens)
    assert len(plain) == len(salted) == len(seeded) == 4
    assert not set(plain) & set(salted) and not set(plain) & set(seeded)
    assert VllmKeyScheme(8).block_hashes(tokens, "") == plain  # vLLM: an empty salt is no salt


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"block_size": 0}, "block_size must be > 0, got 0"),
    ({"algo": "md5"}, "'hash=md5' is not one of vLLM's sha256, sha256_cbor, xxhash, xxhash_cbor"),
    ({"algo": "xxhash"}, "hash=xxhash without hash_seed: vLLM seeds non-cryptographic hashes with random bytes"),
    ({"algo": "xxhash_cbor"}, "set PYTHONHASHSEED on the replica and give it as hash_seed="),
])
def test_unreproducible_settings_are_refused_saying_why(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(UnsupportedHashError) as info:
        VllmKeyScheme(**kwargs)
    assert says in str(info.value)


@pytest.mark.skipif(importlib.util.find_spec("cbor2") is not None, reason="cbor2 is installed here")
def test_sha256_cbor_without_cbor2_is_refused_naming_the_package() -> None:
    with pytest.raises(UnsupportedHashError, match="hash=sha256_cbor serializes with CBOR, which needs the cbor2 "
                                                   "package; it is not a kvstore dependency"):
        VllmKeyScheme(algo="sha256_cbor")


@pytest.mark.skipif(importlib.util.find_spec("xxhash") is not None, reason="xxhash is installed here")
def test_seeded_xxhash_without_the_package_is_refused_naming_it() -> None:
    with pytest.raises(UnsupportedHashError, match="hash=xxhash needs the xxhash package"):
        VllmKeyScheme(algo="xxhash", hash_seed="1")
