"""``kvstore bench peers``: kvstore's rows, the peer protocol, and a clear note for every peer not measured.

The main suite never builds the peers' environments; with --quick the peers are skipped, saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.bench.harness import Progress, Results, SuiteOptions
from kvstore.bench.peers import suite
from kvstore.bench.peers.process import PeerProcess

FAKE_PEER = """
import json, sys
print(json.dumps({"ready": True, "fake": "1.0"}), flush=True)
for i, _ in enumerate(sys.stdin):
    print(json.dumps({"round": i, "figures": [{"name": "fake.lookup", "prompt_tokens": 1024, "ms": 2.0 + i}]}), flush=True)
"""


def test_quick_run_reports_kvstore_rows_and_names_every_skipped_peer(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvstore", "bench", "peers", "--quick", "--no-progress", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    rows = {(f["name"], f["params"]["prompt_tokens"]) for f in doc["figures"]}
    assert rows == {(name, n) for name in ("kvstore.lookup", "kvstore.key_path", "kvstore.commit")
                    for n in suite.QUICK_TOKENS}
    assert all(len(f["params"]["rounds"]) == 2 for f in doc["figures"])
    assert set(doc["skipped"]) == {"vllm", "sglang", "lmcache", "disk_and_host_rows"}
    assert doc["skipped"]["vllm"].startswith("--quick:") and doc["ratios"] == []
    assert "skipped vllm: --quick" in res.stdout + res.stderr


def test_peer_process_runs_rounds_in_order(tmp_path: Path) -> None:
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE_PEER)
    peer = PeerProcess(sys.executable, script, [])
    try:
        assert peer.info == {"ready": True, "fake": "1.0"}
        assert peer.round() == {("fake.lookup", 1024): 2.0}
        assert peer.round() == {("fake.lookup", 1024): 3.0}
    finally:
        peer.close()
    assert peer.proc.returncode == 0


def test_a_peer_that_dies_is_an_error_with_its_stderr(tmp_path: Path) -> None:
    script = tmp_path / "dead_peer.py"
    script.write_text("import sys\nsys.exit('no module named vllm here')\n")
    with pytest.raises(RuntimeError, match=r"dead_peer.py exited \(1\): no module named vllm here"):
        PeerProcess(sys.executable, script, [])


def test_a_peer_whose_python_cannot_run_is_skipped_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_VLLM_PYTHON", str(tmp_path / "absent" / "python"))
    monkeypatch.setattr(suite, "PEERS", {"vllm": suite.PEERS["vllm"]})
    options = SuiteOptions(out_dir=tmp_path, quick=False)
    results = Results("peers", options, {})
    assert suite._start_peers(options, results, (1024,), 1) == {}
    assert results.skipped["vllm"].startswith(f"{tmp_path / 'absent' / 'python'} could not run vllm_lookup.py:")


def test_ratios_are_paired_per_round(tmp_path: Path) -> None:
    results = Results("peers", SuiteOptions(out_dir=tmp_path, quick=True), {})
    samples = {("vllm.lookup", 131072): [20.0, 30.0, 10.0], ("kvstore.key_path", 131072): [5.0, 10.0, 2.0]}
    suite._report(results, samples, (131072,))
    (ratio,) = results.ratios
    assert ratio.name == "speedup.kvstore_key_path/vllm_lookup" and ratio.params["rounds"] == [4.0, 3.0, 5.0]
    assert ratio.value == 4.0 and ratio.target == 5.0 and ratio.met is False
