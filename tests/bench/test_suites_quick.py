"""Every benchmark suite runs with --quick through the CLI and writes a valid results.json and its plot.

Numbers are never checked (no timing assertions); only the schema, units and files.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.bench import SUITES
from kvstore.bench.harness import SCHEMA
from kvstore.bench.mooncake import DEFAULT_TRACE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _trace_slice(tmp_path: Path) -> Path:
    """The first 200 requests of the real trace, or a small synthetic one in its format when it is absent."""
    path = tmp_path / "trace.jsonl"
    if DEFAULT_TRACE.is_file():
        with DEFAULT_TRACE.open() as fh:
            path.write_text("".join(line for _, line in zip(range(200), fh)))
    else:
        rows = [{"timestamp": i, "input_length": 512 * (2 + i % 3) + 7, "output_length": 10,
                 "hash_ids": [0, 1 + i % 5] + [100 + 3 * i + j for j in range(1 + i % 3)]} for i in range(60)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


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


@pytest.mark.parametrize("suite", [s for s in SUITES if s != "soak"])  # soak: tests/bench/test_soak.py
def test_suite_quick_writes_results_and_plot(suite: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvstore", "bench", suite, "--quick", "--no-progress",
           "--out", str(out), "--trace", str(_trace_slice(tmp_path))]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    _check_schema(doc, suite, out)
    assert doc["command"].startswith("kvstore bench " + suite)
    assert [p.name for p in out.iterdir() if p.is_dir()] == [], "scratch data must be removed"


def test_missing_trace_is_skipped_with_a_note(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "kvstore", "bench", "hitrate", "--quick", "--no-progress",
           "--out", str(tmp_path), "--trace", str(tmp_path / "absent.jsonl")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert "mooncake" in doc["skipped"] and "not found" in doc["skipped"]["mooncake"]
    assert "skipped mooncake" in res.stderr
    assert "mooncake" not in {f["params"].get("workload") for f in doc["figures"]}
