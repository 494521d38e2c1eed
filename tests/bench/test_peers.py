"""``python -m benchmarks peers``: kvstore's rows, the peer protocol, and a clear note for every peer not measured.

The main suite never builds the peers' environments; with --quick the peers are skipped, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore.bench.harness import Progress, Results, SuiteOptions
from benchmarks.peers import storage, suite
from benchmarks.peers.process import PeerProcess

FAKE_PEER = """
import json, sys
print(json.dumps({"ready": True, "fake": "1.0"}), flush=True)
for i, _ in enumerate(sys.stdin):
    print(json.dumps({"round": i, "figures": [{"name": "fake.lookup", "prompt_tokens": 1024, "ms": 2.0 + i}]}), flush=True)
"""

FAKE_LMCACHE = """
import json, sys
print(json.dumps({"ready": True, "lmcache": "fake", "args": sys.argv[1:]}), flush=True)
for i, _ in enumerate(sys.stdin):
    print(json.dumps({"round": i, "figures": [
        {"name": "lmcache.disk.buffered.put", "block_bytes": 1048576, "gbps": 0.5 + i},
        {"name": "lmcache.lookup", "prompt_tokens": 1024, "ms": 2.0}]}), flush=True)
"""
DISK_ROWS = ("kvstore.lmdb.put", "kvstore.lmdb.get_cold", "kvstore.slab.put", "kvstore.slab.get_cold", "raw.write", "raw.read",
             "raw.read_parallel")
HOST_ROWS = ("kvstore.host.put", "kvstore.host.get", "memcpy", "memcpy.per_block")
LMCACHE_PYTHON = suite.ROOT / ".venv-lmcache" / "bin" / "python"


def test_quick_run_reports_kvstore_rows_and_names_every_skipped_peer(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks", "peers", "--quick", "--no-progress", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=suite.ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    rows = {(f["name"], f["params"]["prompt_tokens"]) for f in doc["figures"] if "prompt_tokens" in f["params"]}
    assert rows == {(name, n) for name in ("kvstore.lookup", "kvstore.key_path", "kvstore.commit")
                    for n in suite.QUICK_TOKENS}
    disk_host = {(f["name"], f["params"]["block_bytes"]) for f in doc["figures"] if "block_bytes" in f["params"]}
    assert disk_host == ({(name, b) for name in DISK_ROWS for b in storage.DISK_SIZES}
                         | {(name, b) for name in HOST_ROWS for b in storage.HOST_SIZES})
    assert all(len(f["params"]["rounds"]) == 2 for f in doc["figures"])
    assert set(doc["skipped"]) == {"vllm", "sglang", "lmcache", "lmcache_commit"}
    assert doc["skipped"]["vllm"].startswith("--quick:")
    assert {r["name"] for r in doc["ratios"]} == {p[0] for p in storage.PAIRS if "lmcache" not in p[0]}
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


def test_lmcache_peer_gets_the_storage_options_and_answers_times_and_bandwidths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_python: Callable[[str], str]) -> None:
    monkeypatch.setenv("KVSTORE_LMCACHE_PYTHON", fake_python(FAKE_LMCACHE))
    monkeypatch.setattr(suite, "PEERS", {"lmcache": suite.PEERS["lmcache"]})
    options = SuiteOptions(out_dir=tmp_path, quick=False, seed=3)
    bench = storage.StorageBench(options, tmp_path, 8 << 20, {})
    results = Results("peers", options, {})
    (peer,) = suite._start_peers(options, results, (1024,), 2, {"lmcache": bench.peer_args()}).values()
    try:
        assert peer.info["args"][2].endswith("benchmarks/peers/lmcache_storage.py")
        assert peer.info["args"][3:] == ["--lengths", "1024", "--seed", "3", "--repeat", "2", "--data", str(tmp_path),
                                         "--disk-sizes", "262144,1048576", "--host-sizes", "65536,262144,1048576",
                                         "--disk-bytes", str(8 << 20), "--host-bytes", str(8 << 20)]
        assert peer.round_figures()[0] == {"name": "lmcache.disk.buffered.put", "block_bytes": 1048576, "gbps": 0.5}
        assert peer.round() == {("lmcache.lookup", 1024): 2.0}  # the times only
    finally:
        peer.close()
    assert results.config["lmcache"] == {"lmcache": "fake", "python": None, "import_s": None}


def test_storage_ratios_are_paired_per_round_against_lmcaches_best_mode(tmp_path: Path) -> None:
    results = Results("peers", SuiteOptions(out_dir=tmp_path, quick=True), {})
    mib = 1 << 20
    samples = {("kvstore.lmdb.put", mib): [1.0, 2.0, 3.0], ("lmcache.disk.buffered.put", mib): [2.0, 1.0, 1.0],
               ("lmcache.disk.odirect.put", mib): [0.5, 4.0, 1.5]}
    storage.report(results, samples, 8 * mib)
    assert results.value("lmcache.disk.best.put", block_bytes=mib) == 2.0  # per round 2, 4, 1.5
    (best,) = [r for r in results.ratios if r.name == "kvstore.lmdb.put/lmcache.disk.best.put"]
    assert best.params["rounds"] == [0.5, 0.5, 2.0] and best.value == 0.5 and best.target == 1.0 and not best.met
    (buffered,) = [r for r in results.ratios if r.name == "kvstore.lmdb.put/lmcache.disk.buffered.put"]
    assert buffered.value == 2.0 and buffered.target is None


@pytest.mark.skipif(not (LMCACHE_PYTHON.parents[1] / ".installed").exists(),
                    reason="no .venv-lmcache in this checkout (make venv-lmcache; make test builds it)")
@pytest.mark.skipif(os.geteuid() != 0, reason="the LMCache peer's cold reads drop the page cache (root only)")
def test_the_real_lmcache_peer_answers_a_round_with_every_row(tmp_path: Path) -> None:
    for b in (64 << 10, 256 << 10):  # two distinct-enough blocks of each size
        (tmp_path / f"pool-{b}.bin").write_bytes(bytes(range(256)) * (b // 256) + bytes(range(255, -1, -1)) * (b // 256))
    args = ["--data", str(tmp_path), "--disk-sizes", "262144", "--host-sizes", "65536", "--disk-bytes", str(4 << 20),
            "--host-bytes", str(4 << 20), "--lengths", "1024", "--repeat", "1"]
    peer = PeerProcess(str(LMCACHE_PYTHON), suite.LMCACHE_SCRIPT, args)
    try:
        assert peer.info["lmcache"] == "0.5.6"
        names = {(f["name"], f.get("block_bytes", f.get("prompt_tokens"))) for f in peer.round_figures()}
    finally:
        peer.close()
    assert names == ({(f"lmcache.disk.{m}.{op}", 256 << 10) for m in storage.LMCACHE_MODES
                      for op in ("put", "get", "batched_get")}
                     | {("lmcache.cpu.put", 64 << 10), ("lmcache.cpu.get", 64 << 10), ("lmcache.lookup", 1024)})
    assert peer.proc.returncode == 0
