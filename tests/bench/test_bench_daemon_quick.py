"""benchmarks/bench_daemon.py runs end to end on a tiny setting (a daemon per side and client count): every
row carries the embedded, directory and held figures and ratios that match them, and ``--full-host`` runs.
Speed is never checked here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_daemon_writes_both_daemon_paths_against_embedded(tmp_path: Path) -> None:
    out = tmp_path / "daemon.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_daemon.py"), "--clients", "1", "--blocks", "8",
                          "--batch", "4", "--rounds", "2", "--full-host", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| daemon held GB/s |" in run.stdout
    result = json.loads(out.read_text())
    assert result["schema"] == "kvstore-bench-daemon/2" and result["full_host"] is True
    rows = result["results"]
    assert sorted(r["op"] for r in rows) == ["get", "put"]
    for r in rows:
        assert r["embedded_gbps"] > 0 and r["daemon_gbps"] > 0 and r["daemon_held_gbps"] > 0
        assert abs(r["ratio"] - r["daemon_gbps"] / r["embedded_gbps"]) < 0.01
        assert abs(r["held_ratio"] - r["daemon_held_gbps"] / r["embedded_gbps"]) < 0.01
    assert out.with_suffix(".png").stat().st_size > 0
