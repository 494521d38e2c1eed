"""Two engine processes that share no disk, only a Redis server: one computes a prompt, the other (empty
GPU, host and disk) loads the prefix from Redis, and its output equals recompute (the connector oracle
through the remote tier), also when ``write_back`` sent the groups as a small disk evicted them. Tenants
never hit each other's blocks through it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from connlib import GREEDY, capture_logits, make_llm, prompt

from benchmarks.redis_servers import RedisServer

PROMPT = prompt(1, 45)  # 11 full blocks of 4 and one partial: two groups of 4 go remote, 3 blocks stay local


def _remote(server: RedisServer, prefix: str) -> dict[str, object]:
    return {"tiers": ["host", "lmdb", "remote"],
            "remote": {"url": server.url, "group_blocks": 4, "key_prefix": prefix, "timeout_s": 1.0,
                       "probe_timeout_s": 5.0}}  # a loaded machine never cuts a probe short here


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], torch.Tensor]:
    llm = make_llm(None)
    logits = capture_logits(llm)
    out = llm.generate([PROMPT], GREEDY)[0]
    return out.token_ids, logits[out.request_id]


def test_a_second_engine_process_loads_the_prefix_from_redis_and_matches_recompute(
        tmp_path: Path, redis_server: RedisServer, reference) -> None:  # noqa: ANN001
    here = Path(__file__).parent.parent / "connector"
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(here)!r})
        from pathlib import Path
        from connlib import GREEDY, make_llm, prompt
        llm = make_llm(Path({str(tmp_path / "first")!r}), **{_remote(redis_server, "engine:")!r})
        out = llm.generate([prompt(1, 45)], GREEDY)[0]
        llm.connector.flush()
        print(out.token_ids)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONHASHSEED="91"))
    assert res.returncode == 0, res.stderr
    llm = make_llm(tmp_path / "second", **_remote(redis_server, "engine:"))  # its own (empty) disk
    logits = capture_logits(llm)
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.metrics.cached_tokens_by_tier == {"gpu": 0, "host": 0, "disk": 0, "remote": 32}
    assert out.token_ids == reference[0] and str(out.token_ids) == res.stdout.strip()
    torch.testing.assert_close(logits[out.request_id], reference[1], rtol=1e-5, atol=1e-5)
    st = llm.connector.stats()  # type: ignore[union-attr]
    assert st["remote"]["loaded_blocks"] == 8 and st["remote"]["errors"] == 0
    assert st["disk"]["hits"] == 0 and st["host"]["hits"] == 0  # nothing local: every cached token came over Redis
    llm.connector.close()  # type: ignore[union-attr]


def test_tenants_never_hit_each_others_blocks_through_redis(tmp_path: Path, redis_server: RedisServer,
                                                            reference) -> None:  # noqa: ANN001
    first = make_llm(tmp_path / "a", **_remote(redis_server, "tenants:"))
    first.generate([PROMPT], GREEDY, cache_salt="tenant-a")
    first.connector.flush()  # type: ignore[union-attr]
    first.connector.close()  # type: ignore[union-attr]
    other = make_llm(tmp_path / "b", **_remote(redis_server, "tenants:"))
    for salt in ("tenant-b", None):
        out = other.generate([PROMPT], GREEDY, cache_salt=salt)[0]
        assert out.metrics.num_cached_tokens == 0 and out.token_ids == reference[0]
    same = make_llm(tmp_path / "c", **_remote(redis_server, "tenants:"))
    out = same.generate([PROMPT], GREEDY, cache_salt="tenant-a")[0]
    assert out.metrics.cached_tokens_by_tier["remote"] == 32 and out.token_ids == reference[0]
    for llm in (other, same):
        llm.connector.close()  # type: ignore[union-attr]


def test_write_back_groups_evicted_by_a_small_disk_reach_a_second_engine(
        tmp_path: Path, redis_server: RedisServer, reference) -> None:  # noqa: ANN001
    """``remote.write: write_back`` under a disk of 6 blocks: the disk evicts the sequence's early blocks as
    its later ones are written through, so exactly the two full groups with an evicted block go to Redis
    (the third stays on disk), and an engine with empty local tiers loads them and matches recompute."""
    small = {**_remote(redis_server, "wbdisk:"), "disk": {"path": str(tmp_path / "first" / "lmdb"), "max_size": 24 * 4096}}
    small["remote"] = {**small["remote"], "write": "write_back"}  # type: ignore[dict-item]
    first = make_llm(tmp_path / "first", **small)
    first.generate([PROMPT], GREEDY)
    first.connector.flush()  # type: ignore[union-attr]
    st = first.connector.stats()  # type: ignore[union-attr]
    assert st["disk"]["evictions"] > 0 and st["disk"]["num_blocks"] == 6  # the last six blocks stay: one full group
    assert (st["remote"]["groups_stored"], st["remote"]["spilled_blocks"], st["remote"]["skipped_groups"]) == (2, 8, 0)
    first.connector.close()  # type: ignore[union-attr]
    second = make_llm(tmp_path / "second", **_remote(redis_server, "wbdisk:"))
    logits = capture_logits(second)
    out = second.generate([PROMPT], GREEDY)[0]
    assert out.metrics.cached_tokens_by_tier == {"gpu": 0, "host": 0, "disk": 0, "remote": 32}
    assert out.token_ids == reference[0]
    torch.testing.assert_close(logits[out.request_id], reference[1], rtol=1e-5, atol=1e-5)
    second.connector.close()  # type: ignore[union-attr]
