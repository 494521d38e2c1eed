"""Keys for pages an engine names only by its own page hashes (connectors/engine_keys.py): tenant and model apart."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from connectors.engine_keys import engine_page_keys
from kvstore.hashing import block_keys, chain_key, root_key
from kvstore.layout import KVLayout

HASHES = ["a" * 64, "b" * 64, "c" * 64]


def test_engine_page_keys_separate_tenants_models_and_namespaces(layout: KVLayout) -> None:
    base = engine_page_keys(layout, "tenant-a", "sglang|x", HASHES)
    assert len(base) == 3 and len(set(base)) == 3 and all(len(k) == 32 for k in base)
    assert engine_page_keys(layout, "tenant-a", "sglang|x", HASHES) == base
    others = [
        engine_page_keys(layout, "tenant-b", "sglang|x", HASHES),
        engine_page_keys(layout, None, "sglang|x", HASHES),
        engine_page_keys(dataclasses.replace(layout, model_id="other"), "tenant-a", "sglang|x", HASHES),
        engine_page_keys(dataclasses.replace(layout, dtype="bfloat16"), "tenant-a", "sglang|x", HASHES),
        engine_page_keys(layout, "tenant-a", "sglang|y", HASHES),
    ]
    for keys in others:
        assert not set(keys) & set(base)


def test_engine_page_keys_never_equal_a_token_chain_key(layout: KVLayout) -> None:
    # a page hash whose bytes are a block's token bytes still gets another key (another BLAKE2b personalisation)
    page = "\x01\x00\x00\x00" * layout.block_size
    key = engine_page_keys(layout, None, "", [page])[0]
    assert key != chain_key(root_key(layout), page.encode()) and key not in block_keys([1] * 4, layout)


def test_an_empty_page_hash_is_refused_by_position(layout: KVLayout) -> None:
    with pytest.raises(ValueError, match="engine page hash 1 of 2 is empty"):
        engine_page_keys(layout, None, "sglang", ["a", ""])


def test_engine_page_keys_are_the_same_in_another_process(layout: KVLayout) -> None:
    code = (
        "from connectors.engine_keys import engine_page_keys\nfrom kvstore.layout import KVLayout\n"
        f"print(engine_page_keys(KVLayout(**{dataclasses.asdict(layout)!r}), 's', 'ns', {HASHES!r})[2].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == engine_page_keys(layout, "s", "ns", HASHES)[2].hex()
