"""Block keys: chained, stable across processes, isolated by salt and layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.hashing import block_keys, chain_key, root_key
from kvstore.layout import KVLayout

_SCRIPT = """
import json, sys
from kvstore import KVLayout, block_keys
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", model_id="test")
toks = list(range(100, 141))
print(json.dumps([k.hex() for k in block_keys(toks, layout, salt="tenant-a")]))
"""


def _keys_in_subprocess(seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, check=True, timeout=120)
    return json.loads(out.stdout)


def test_keys_identical_across_processes_with_different_hash_seeds(layout: KVLayout) -> None:
    a = _keys_in_subprocess("1")
    b = _keys_in_subprocess("987654")
    here = [k.hex() for k in block_keys(list(range(100, 141)), layout, salt="tenant-a")]
    assert a == b == here
    assert len(a) == 10  # 41 tokens, block size 4: the partial block gets no key


def test_known_answer(layout: KVLayout) -> None:
    # Pinned so an accidental change of the key format (which would orphan every disk tier) fails here.
    keys = block_keys([1, 2, 3, 4, 5, 6, 7, 8], layout)
    assert [k.hex()[:16] for k in keys] == KNOWN


KNOWN = ["dbc8f20068af6d4b", "c7161fc24a687455"]


def test_chain_property(layout: KVLayout) -> None:
    toks = list(range(32))
    keys = block_keys(toks, layout)
    assert len(keys) == 8 and len(set(keys)) == 8 and all(len(k) == 32 for k in keys)
    # A key names its whole prefix: a change in block 0 changes every later key.
    changed = block_keys([999] + toks[1:], layout)
    assert all(a != b for a, b in zip(keys, changed))
    # A change in block 5 leaves keys 0..4 alone.
    later = block_keys(toks[:21] + [999] + toks[22:], layout)
    assert later[:5] == keys[:5] and all(a != b for a, b in zip(keys[5:], later[5:]))
    # Continuing from a parent gives the same chain.
    assert block_keys(toks[16:], layout, parent=keys[3]) == keys[4:]
    # numpy input gives the same keys as a list.
    assert block_keys(np.arange(32, dtype=np.int64), layout) == keys


def test_salt_and_layout_isolate(layout: KVLayout) -> None:
    toks = list(range(16))
    base = block_keys(toks, layout)
    assert block_keys(toks, layout, salt=None) == block_keys(toks, layout, salt=b"") == base
    a = block_keys(toks, layout, salt="a")
    b = block_keys(toks, layout, salt="b")
    assert len({*base, *a, *b}) == 12
    assert block_keys(toks, layout, salt="a") == block_keys(toks, layout, salt=b"a")
    for other in (
        KVLayout(2, 2, 8, 4, "bfloat16", "test"),
        KVLayout(3, 2, 8, 4, "float16", "test"),
        KVLayout(2, 2, 8, 4, "float16", "other-model"),
    ):
        assert not set(block_keys(toks, other)) & set(base)
        assert root_key(other) != root_key(layout)


def test_block_keys_equal_the_per_block_definition(layout: KVLayout) -> None:
    """block_keys (the fast path) gives byte for byte the chain of chain_key over root_key, for lists, numpy
    and tuples, with salts, parents and partial tails; a bad token only in the partial tail is never read."""
    rng = np.random.default_rng(7)
    bs = layout.block_size
    for n in (0, 1, bs, bs + 1, 7 * bs, 7 * bs + bs - 1, 333):
        toks = rng.integers(0, 2**32, size=n, dtype=np.uint64).tolist()
        for salt in (None, "tenant-a", b"\x00"):
            for parent in (None, b"\x01" * 32):
                key = root_key(layout, salt) if parent is None else parent
                want = []
                for i in range(n // bs):
                    key = chain_key(key, b"".join(t.to_bytes(4, "little") for t in toks[i * bs : (i + 1) * bs]))
                    want.append(key)
                for inp in (toks, np.array(toks, dtype=np.uint32), tuple(toks)):
                    assert block_keys(inp, layout, salt, parent) == want
        if n % bs:
            assert block_keys(toks[:-1] + [2**40], layout) == block_keys(toks, layout)


def test_partial_and_empty(layout: KVLayout) -> None:
    assert block_keys([], layout) == []
    assert block_keys([1, 2, 3], layout) == []
    assert len(block_keys(list(range(7)), layout)) == 1


def test_bad_tokens(layout: KVLayout) -> None:
    with pytest.raises(ValueError, match="token ids"):
        block_keys([-1, 2, 3, 4], layout)
    with pytest.raises(TypeError, match="integers"):
        block_keys([0.5, 1.0, 2.0, 3.0], layout)
    with pytest.raises(TypeError, match="salt"):
        block_keys([1, 2, 3, 4], layout, salt=5)  # type: ignore[arg-type]


def test_layout_validation_and_sizes() -> None:
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    assert lay.bytes_per_block == 32 * 2 * 16 * 8 * 128 * 2
    assert lay.bytes_per_token == 32 * 2 * 8 * 128 * 2
    with pytest.raises(ValueError, match="num_layers"):
        KVLayout(num_layers=0, num_kv_heads=1, head_dim=1, block_size=1)
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(1, 1, 1, 1, dtype="int8")  # type: ignore[arg-type]
