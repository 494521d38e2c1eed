"""The connector API owns its types: another store implements it from ``connectors.base`` alone.

The connector API owns its types: ``connectors/base.py``
imports no store internals (statically and at run time), a dict-backed
connector written against it drives the engine to the recompute oracle's
output, and the embedded connector hands out the API's own types and
refuses matches and leases it did not make.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from connectors.base import DAEMON_TIERS, KVConnector, Lease, PrefixMatch
from connectors.embedded import EmbeddedConnector
from connlib import BLOCK, GREEDY, capture_logits, engine_config, kv_config, make_llm, prompt
from dictconn import DictConnector, DictLease
from engine import LLM
from engine.connector_manager import ConnectorBlockManager
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout

REPO = Path(__file__).resolve().parents[2]
PROMPT = prompt(1, 45)  # 11 full blocks of 4 and one partial
ALLOWED_KVSTORE = {"kvstore.store.gpu_pool", "kvstore.hashing", "kvstore.layout", "kvstore.errors"}
STORE_INTERNALS = ("kvstore.store.tiered", "kvstore.store.prefetch", "kvstore.store.spill", "kvstore.store.hierarchy", "kvstore.store.placement",
                   "kvstore.policy.gpu_lru", "kvstore.store.host_slot", "kvstore.store.match", "kvstore.tiers", "kvstore.daemon")


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (functions and TYPE_CHECKING blocks included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # `from kvstore import store`
    return out


@pytest.mark.parametrize("path", ["connectors/base.py", "tests/connector/dictconn.py"])
def test_api_and_fake_store_import_no_store_internals(path: str) -> None:
    mods = _imported_modules(REPO / path)
    kvstore_mods = {m for m in mods if m.split(".")[0] == "kvstore"}
    used = {m for m in kvstore_mods if m in ALLOWED_KVSTORE or m.rsplit(".", 1)[0] in ALLOWED_KVSTORE}
    assert kvstore_mods == used, f"{path} imports {sorted(kvstore_mods - used)}"
    assert not {m for m in mods if m.split(".")[0] == "engine"}, f"{path} imports the engine"
    assert {m for m in mods if m.split(".")[0] == "connectors"} <= {"connectors.base", "connectors.base.KVConnector",
                                                                    "connectors.base.Lease",
                                                                    "connectors.base.PrefixMatch"}


def test_importing_the_api_loads_no_store() -> None:
    code = ("import sys, connectors.base, connectors; "
            f"print(sorted(m for m in sys.modules if m.startswith({STORE_INTERNALS!r})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_api_surface() -> None:
    """What another store must implement; ``commit`` is built on ``commit_keys``, ``lookup_keys`` is gone."""
    assert KVConnector.__abstractmethods__ == {
        "register", "layout", "keys", "lookup", "acquire", "release", "allocate", "free", "commit_keys", "save",
        "offload", "flush", "stats", "close"}
    assert Lease.__abstractmethods__ == {"block_ids", "shortfall", "load_wait_s", "resolve", "wait_layer", "wait",
                                         "tokens_by_tier"}


def test_prefix_match_is_frozen_and_checked() -> None:
    m = PrefixMatch((b"a", b"b", b"c"), ("gpu", "disk", "disk"), 4, 14, handle=object())
    assert (m.num_blocks, m.num_tokens, m.tokens_in("disk")) == (3, 12, 8)
    assert m.tokens_by_tier() == {"gpu": 4, "host": 0, "disk": 8}
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.keys = ()  # type: ignore[misc]
    with pytest.raises(ValueError, match="2 keys but 1 tiers"):
        PrefixMatch((b"a", b"b"), ("gpu",), 4, 8)
    with pytest.raises(ValueError, match=r"unknown tier\(s\) \['ssd'\]"):
        PrefixMatch((b"a",), ("ssd",), 4, 4)
    with pytest.raises(ValueError, match="block_size must be positive"):
        PrefixMatch((), (), 0, 0)


# ------------------------------------------------------------- a foreign store
@pytest.fixture(scope="module")
def reference() -> tuple[list[int], torch.Tensor]:
    llm = make_llm(None)
    logits = capture_logits(llm)
    out = llm.generate([PROMPT], GREEDY)[0]
    return out.token_ids, logits[out.request_id]


def test_dict_connector_drives_the_engine_to_the_oracle(reference) -> None:  # noqa: ANN001
    conn = DictConnector()
    llm = LLM(config=engine_config(), connector=conn)
    logits = capture_logits(llm)
    first = llm.generate([PROMPT], GREEDY)[0]
    second = llm.generate([PROMPT], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.cached_tokens_by_tier == {"gpu": 44, "host": 0, "disk": 0}
    assert second.metrics.num_prefill_tokens_computed == 1
    for out in (first, second):
        assert out.token_ids == reference[0]
        torch.testing.assert_close(logits[out.request_id], reference[1], rtol=1e-5, atol=1e-5)
    # Every sequence gave back its references: only the cache's own remain.
    assert llm.pool.num_used == len(conn.cached) and all(llm.pool.ref_count(b) == 1 for b in conn.cached.values())
    # 45 prompt + 5 computed generated tokens: 12 full blocks committed, all dropped (no tier below).
    assert conn.offload("gpu") == 12 and llm.pool.num_used == 0
    third = llm.generate([PROMPT], GREEDY)[0]
    assert third.metrics.num_cached_tokens == 0 and third.token_ids == reference[0]


def test_block_manager_over_dict_connector_holds_and_returns_lease_blocks() -> None:
    conn = DictConnector()
    llm = LLM(config=engine_config(32), connector=conn)
    mgr, pool = llm.block_manager, llm.pool
    assert isinstance(mgr, ConnectorBlockManager)
    tokens = list(range(4 * BLOCK + 2))
    blocks = conn.allocate(5)
    assert conn.commit(tokens, blocks) == 4  # the token form of commit, built on commit_keys
    conn.free(blocks)
    seq = llm.add_request(tokens, GREEDY)  # queued, not stepped: the test admits it by hand
    mgr.admit(seq)
    assert seq.num_cached_tokens == 4 * BLOCK and seq.block_table == blocks[:4]
    assert [pool.ref_count(b) for b in blocks[:4]] == [2, 2, 2, 2]  # the cache's and the lease's
    assert seq.metrics.cached_tokens_by_tier == {"gpu": 16, "host": 0, "disk": 0}
    mgr.free(seq)
    assert [pool.ref_count(b) for b in blocks[:4]] == [1, 1, 1, 1] and pool.ref_count(blocks[4]) == 0

# ----------------------------------------------------- the embedded adaptation
def _embedded(root: Path) -> tuple[EmbeddedConnector, GPUBlockPool]:
    pool = GPUBlockPool(KVLayout(2, 2, 16, BLOCK, "float32"), 32, device="cpu")
    conn = EmbeddedConnector(kv_config(root, write="write_back"))
    conn.register(pool)
    return conn, pool


def test_embedded_connector_speaks_the_api_types(tmp_path: Path) -> None:
    conn, pool = _embedded(tmp_path)
    try:
        tokens = list(range(3 * BLOCK + 1))
        blocks = conn.allocate(4)
        assert conn.commit(tokens, blocks) == 3
        conn.free(blocks)
        match = conn.lookup(tokens)
        assert type(match) is PrefixMatch
        assert (match.tiers, match.prompt_tokens, match.num_tokens) == (("gpu",) * 3, 13, 12)
        assert list(match.keys) == conn.keys(tokens)
        lease = conn.acquire(match)
        assert isinstance(lease, Lease)
        assert (lease.resolve(), lease.block_ids, lease.shortfall) == (12, blocks[:3], None)
        assert lease.num_cached_tokens == 12 and lease.tokens_by_tier() == {"gpu": 12, "host": 0, "disk": 0}
        lease.wait()
        conn.release(lease)
        conn.release(lease)  # idempotent
        assert [pool.ref_count(b) for b in blocks] == [1, 1, 1, 0]  # only the cache's references remain
    finally:
        conn.close()


def test_offload_through_the_api_moves_a_prefix_down_tier_by_tier(tmp_path: Path) -> None:
    conn, pool = _embedded(tmp_path)
    try:
        tokens = list(range(3 * BLOCK))
        blocks = conn.allocate(3)
        conn.commit(tokens, blocks)
        conn.free(blocks)
        assert conn.offload("gpu") == 3 and pool.num_used == 0
        assert conn.lookup(tokens).tiers == ("host",) * 3
        assert conn.offload("host") == 3
        conn.flush()
        assert conn.lookup(tokens).tiers == ("disk",) * 3
        with pytest.raises(ValueError, match="'disk'"):
            conn.offload("disk")
    finally:
        conn.close()


def test_embedded_connector_refuses_foreign_matches_and_leases(tmp_path: Path) -> None:
    conn, _ = _embedded(tmp_path / "a")
    other, _ = _embedded(tmp_path / "b")
    try:
        tokens = list(range(2 * BLOCK))
        with pytest.raises(TypeError, match="handle is NoneType"):
            conn.acquire(PrefixMatch((), (), BLOCK, 0))
        with pytest.raises(ValueError, match="another connector"):
            conn.acquire(other.lookup(tokens))
        with pytest.raises(TypeError, match="got DictLease"):
            conn.release(DictLease([], BLOCK))
        lease = other.acquire(other.lookup(tokens))
        with pytest.raises(ValueError, match="another connector"):
            conn.release(lease)
        other.release(lease)
    finally:
        conn.close()
        other.close()


@pytest.mark.parametrize("path", ["kvstore/cli/demo.py", "kvstore/bench/e2e.py"])
def test_demo_and_benchmark_use_the_api_not_the_store(path: str) -> None:
    tree = ast.parse((REPO / path).read_text(), path)
    reach = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("store", "h")]
    assert reach == [], f"{path} reaches into the store at lines {reach}"
    assert not {m for m in _imported_modules(REPO / path) if m.startswith(("kvstore.store.tiered", "kvstore.store.prefetch"))}


def test_match_tiers_are_the_connectors_own() -> None:
    m = PrefixMatch((b"a", b"b", b"c"), ("gpu", "daemon:disk", "daemon:host"), 4, 13, tier_names=DAEMON_TIERS)
    assert m.tokens_by_tier() == {"gpu": 4, "host": 0, "daemon:host": 4, "daemon:disk": 4}
    assert m.remote_tier == "daemon:remote"
    far = PrefixMatch((b"a", b"b"), ("daemon:host", "daemon:remote"), 4, 8, tier_names=DAEMON_TIERS)
    assert far.tokens_by_tier() == {"gpu": 0, "host": 0, "daemon:host": 4, "daemon:disk": 0, "daemon:remote": 4}
    with pytest.raises(ValueError, match="unknown tier"):
        PrefixMatch((b"a",), ("daemon:disk",), 4, 4)  # a local connector reaches no daemon
    with pytest.raises(ValueError, match="unknown tier"):
        PrefixMatch((b"a",), ("remote",), 4, 4, tier_names=DAEMON_TIERS)  # a sidecar's remote is the daemon's
    with pytest.raises(ValueError, match="unknown tier name"):
        PrefixMatch((), (), 4, 0, tier_names=("gpu", "sidecar"))  # the name of old: a daemon hit names its tier
    with pytest.raises(ValueError, match="unknown tier name"):
        PrefixMatch((), (), 4, 0, tier_names=("gpu", "ssd"))
