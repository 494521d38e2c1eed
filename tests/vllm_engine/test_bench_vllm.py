"""``python -m benchmarks vllm --quick`` runs its three real vLLM set-ups and writes results.json and its plot.

Only the schema and the bookkeeping are checked (no timing assertions): every
set-up reports TTFT and where its prompt tokens came from, and the kvstore
set-up loads tokens from kvstore, which the daemon counts by tier.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import rig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def value(doc: dict, name: str, **params: object) -> float:
    for f in doc["figures"]:
        if f["name"] == name and all(f["params"].get(k) == v for k, v in params.items()):
            return float(f["value"])
    raise KeyError(name)


def test_bench_vllm_quick_writes_results_and_plot(tmp_path: Path) -> None:
    main_python = rig.REPO / ".venv" / "bin" / "python"  # kvstore's own environment runs the suite; vLLM's the engines
    out = tmp_path / "out"
    res = subprocess.run([str(main_python), "-m", "benchmarks", "vllm", "--quick", "--no-progress",
                          "--vllm-python", sys.executable, "--out", str(out)],
                         capture_output=True, text=True, timeout=900, cwd=rig.REPO)  # where `benchmarks` imports
    assert res.returncode == 0, res.stderr[-4000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["suite"] == "vllm" and doc["plots"] == ["vllm.png"]
    assert (out / "vllm.png").read_bytes()[:8] == PNG_MAGIC
    assert "lmcache" in doc["skipped"]
    n = doc["config"]["requests"]
    for setup in ("vllm", "kvstore", "recompute", "floor"):
        assert value(doc, "ttft_p50", setup=setup) > 0
        assert value(doc, "ttft_p90", setup=setup) >= value(doc, "ttft_p50", setup=setup)
    assert value(doc, "tokens_from_kvstore", setup="vllm") == 0
    assert value(doc, "tokens_from_vllm_cache", setup="recompute") == 0
    tiers = sum(f["value"] for f in doc["figures"] if f["name"] == "tokens_from_kvstore_tier")
    assert tiers > 0 and value(doc, "tokens_from_kvstore", setup="kvstore") > 0
    assert value(doc, "first_tokens_equal_to_recompute", setup="kvstore") <= n
    names = {r["name"]: r for r in doc["ratios"]}
    assert names["ttft_p50_vllm_over_kvstore"]["target"] == 3.0
    assert names["decode_kvstore_over_vllm"]["target"] == 0.95
    assert names["ttft_p50_floor_over_kvstore"]["target"] == round(1 / 1.3, 3)
    assert value(doc, "tokens_from_kvstore", setup="floor") == 0
    steps = {f["params"]["step"]: f["value"] for f in doc["figures"] if f["name"] == "load_step_s"}
    assert set(steps) == {"probe", "read", "write"} and all(v > 0 for v in steps.values())  # kvstore loaded
    for setup in ("vllm", "kvstore"):  # the fault phase: TTFT while the daemon is paused, both set-ups
        assert value(doc, "pause_ttft_p99", setup=setup) >= value(doc, "pause_ttft_p50", setup=setup) > 0
    assert names["pause_ttft_p50_vllm_over_kvstore"]["target"] == round(1 / 1.1, 3)
    assert value(doc, "pause_s") >= 8.0
    assert value(doc, "resume_loaded_tokens", setup="kvstore") > 0  # after SIGCONT kvstore serves again


def test_bench_route_with_vllm_replicas_writes_results_and_plot(tmp_path: Path) -> None:
    """``python -m benchmarks route --replicas vllm``: round robin and kvstore route on two real vLLM replicas, same run."""
    main_python = rig.REPO / ".venv" / "bin" / "python"
    out = tmp_path / "out"
    res = subprocess.run([str(main_python), "-m", "benchmarks", "route", "--replicas", "vllm", "--quick",
                          "--trace-limit", "6", "--no-progress", "--vllm-python", sys.executable, "--out", str(out)],
                         capture_output=True, text=True, timeout=900, cwd=rig.REPO)  # where `benchmarks` imports
    assert res.returncode == 0, res.stderr[-4000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["suite"] == "route" and doc["config"]["replicas"] == "vllm" and doc["config"]["requests"] == 6
    assert (out / "route.png").read_bytes()[:8] == PNG_MAGIC
    for mode in ("round_robin", "kvstore"):
        assert 0 <= value(doc, "hit_rate", mode=mode) <= 1 and value(doc, "ttft_p50", mode=mode) > 0
        assert value(doc, "share", mode=mode, replica="r1") + value(doc, "share", mode=mode, replica="r2") == 1
    assert value(doc, "share", mode="round_robin", replica="r1") == 0.5
    assert value(doc, "hit_rate", mode="round_robin") <= value(doc, "hit_rate_limit") <= 1
    assert {r["name"] for r in doc["ratios"]} == {"hit_rate.kvstore/round_robin", "ttft_p50.kvstore/round_robin"}
