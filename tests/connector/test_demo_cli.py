"""`kvstore demo` runs end to end and, on a second run, serves the first turn from disk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _demo(cwd: Path) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "kvstore", "demo", "--model", "builtin", "--users", "2", "--turns", "3", "--max-tokens", "4", "--no-progress"],
        capture_output=True, text=True, cwd=cwd, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def _rows(out: str) -> list[list[float]]:
    """The table's rows: turn, prompt, gpu, host, disk, computed tokens, TTFT ms, no-cache TTFT ms, speedup."""
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 9 and parts[-1].endswith("x") and all(p.replace(".", "").isdigit() for p in parts[:-1]):
            rows.append([float(p) for p in parts[:-1]] + [float(parts[-1][:-1])])
    return rows


def test_demo_reports_every_tier_and_reuses_disk_after_restart(tmp_path: Path) -> None:
    out = _demo(tmp_path)
    assert "turn 1, user 0:" not in out  # the answers only with --show-answers
    first = _rows(out)
    assert [r[0] for r in first] == [1, 2, 3]
    for turn, prompt_tok, gpu, host, disk, computed, ttft, no_cache, speedup in first:
        assert gpu + host + disk + computed >= prompt_tok  # every prompt token is cached or computed
        assert ttft > 0 and no_cache > 0 and speedup > 0  # both times measured, the ratio shown
    assert first[1][3] > 0  # turn 2 hits the host tier (blocks moved down after turn 1)
    assert first[0][4] == 0  # nothing on disk on a fresh run
    second = _rows(_demo(tmp_path))
    assert second[0][4] > 0  # a new process finds turn 1's prefix on disk


def test_demo_rejects_bad_arguments(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "kvstore", "demo", "--users", "0"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and "--users" in res.stderr and "positive integer" in res.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy:\n  write: sometimes\n")
    res = subprocess.run([sys.executable, "-m", "kvstore", "demo", "--config", str(bad)], capture_output=True,
                         text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and "policy.write" in res.stderr and str(bad) in res.stderr
