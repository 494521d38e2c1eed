"""SIGTERM during a benchmark removes its temporary directory, as Ctrl-C does, and exits 143."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


def test_sigterm_during_a_benchmark_removes_its_scratch_directory(tmp_path: Path) -> None:
    data = tmp_path / "data"
    # e2e keeps its scratch directory (the LMDB and file tiers of every mode) for the whole measured run
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "bench", "e2e", "--quick", "--no-progress",
                             "--out", str(tmp_path / "out"), "--data-dir", str(data)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        scratch: list[Path] = []
        while not scratch and time.monotonic() < deadline and proc.poll() is None:
            scratch = list(data.glob("kvstore-bench-*")) if data.exists() else []
            time.sleep(0.02)
        assert scratch, "the benchmark never created its scratch directory"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert rc == 128 + signal.SIGTERM, stderr[-2000:]
    assert list(data.iterdir()) == [], "the scratch directory must be removed"
    assert stderr.splitlines()[-1] == "terminated" and "Traceback" not in stderr
