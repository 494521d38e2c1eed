"""The soak suite: a short real run (daemon and clients killed -9) loses nothing, serves nothing wrong, cleans up.

The run's figures are never checked for speed or memory (benchmarks report
them); only its correctness counters, its schema and its cleanup.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.bench.soak import SoakPlan
from kvstore.bench.soak_blocks import Journal, OpCounts, block_bytes, block_key, journal_path, read_journals
from kvstore.bench.soak_procs import RssSample
from kvstore.bench.soak_report import growth_mb_per_min
from test_suites_quick import _check_schema

FIGURES = {
    "acked.lost", "served.wrong", "served.foreign", "acked.checked", "daemon.rss_growth", "daemon.rss_anon_growth",
    "daemon.rss_file_growth", "daemon.rss_peak", "daemon.rss_anon_peak", "holds.client_death",
    "host.reserved.client_death", "client.puts", "client.puts_ok", "client.gets", "client.hits", "client.flushes",
    "client.flush_failures", "client.acked", "client.block_ops_per_s", "kills.client", "kills.daemon",
    "restarts.client", "restarts.daemon", "crashes.client", "crashes.daemon", "disk.evictions",
    "daemon.write_failures", "daemon.exit_code", "duration",
}


@pytest.fixture
def run_tmp() -> Iterator[Path]:
    """A private, short $TMPDIR for the soak's run directory (its socket path must stay short), so a check
    that the run left nothing there does not see other processes' runs."""
    path = Path(tempfile.mkdtemp(prefix="kvst", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _soak_dirs(tmp: Path) -> set[str]:
    return {p.name for p in tmp.glob("kvsoak*")}


def _value(doc: dict, name: str, **params: object) -> float:
    return next(f["value"] for f in doc["figures"]
                if f["name"] == name and all(f["params"].get(k) == v for k, v in params.items()))


def test_short_soak_loses_nothing_and_serves_nothing_wrong(tmp_path: Path, run_tmp: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvstore", "bench", "soak", "--quick", "--minutes", "0.1", "--clients", "2",
           "--no-progress", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(run_tmp)})
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    _check_schema(doc, "soak", out)
    assert {f["name"] for f in doc["figures"]} == FIGURES
    assert {f["params"]["when"] for f in doc["figures"] if f["name"] == "holds.client_death"} == {
        "at_kill", "immediately", "after_deadline"}
    assert doc["config"]["minutes"] == 0.1 and doc["config"]["clients"] == 2
    assert _value(doc, "acked.lost") == 0
    assert _value(doc, "served.wrong") == 0
    assert _value(doc, "acked.checked") > 0, "the clients must have had blocks acknowledged"
    assert _value(doc, "kills.daemon") >= 2  # one in the run, one before the final check
    assert _value(doc, "kills.client") >= 3  # one in the run, then both at once
    assert _value(doc, "crashes.client") == 0 and _value(doc, "crashes.daemon") == 0
    assert _value(doc, "disk.evictions") == 0
    assert _value(doc, "daemon.exit_code") == 0
    assert _value(doc, "holds.client_death", when="after_deadline") == 0
    assert _soak_dirs(run_tmp) == set(), "the run's temporary directory must be removed"


def test_a_soak_with_tenants_and_local_clients_mixed_serves_no_block_across_identities(
        tmp_path: Path, run_tmp: Path) -> None:
    """Two tenants and untenanted local clients on one daemon, with kills: each identity's acknowledged blocks
    survive, and no block of one identity is ever served to another (asked during the run and at the end)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvstore", "bench", "soak", "--quick", "--minutes", "0.15", "--clients", "3",
           "--tenants", "2", "--no-progress", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(run_tmp)})
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["tenants"] == 2
    assert _value(doc, "acked.lost") == 0 and _value(doc, "served.wrong") == 0
    assert _value(doc, "acked.checked") > 0
    foreign = next(f for f in doc["figures"] if f["name"] == "served.foreign")
    assert foreign["value"] == 0 and foreign["params"]["asked"] > 0, foreign
    assert _value(doc, "crashes.client") == 0 and _value(doc, "crashes.daemon") == 0
    assert _value(doc, "daemon.exit_code") == 0


def test_tenants_need_more_clients_than_tenants(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "kvstore", "bench", "soak", "--quick", "--clients", "2", "--tenants",
                          "2", "--no-progress", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "--tenants 2 needs more than 2 --clients" in res.stderr


def test_sigterm_stops_the_soak_and_removes_its_children_and_files(tmp_path: Path, run_tmp: Path) -> None:
    data = tmp_path / "data"
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "bench", "soak", "--minutes", "5", "--clients", "1",
                             "--no-progress", "--out", str(tmp_path / "out"), "--data-dir", str(data)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(run_tmp)})
    try:
        deadline = time.monotonic() + 120
        journals: list[Path] = []
        while not journals and time.monotonic() < deadline and proc.poll() is None:
            journals = [j for d in _soak_dirs(run_tmp) for j in (run_tmp / d).glob("journal-*.jsonl")
                        if j.stat().st_size]
            time.sleep(0.1)
        assert journals, "the soak's client never connected"
        run_dir = str(journals[0].parent)
        children = _pids_mentioning(run_dir)
        assert children, "the daemon and the client run with the run directory on their command lines"
        assert [p.name for p in data.iterdir()][0].startswith("kvsoak-data-"), "LMDB goes under --data-dir"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 143, proc.stderr.read().decode()[-2000:] if proc.stderr else rc
    assert not Path(run_dir).exists() and list(data.iterdir()) == []
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"]


def _pids_mentioning(text: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def _state(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
    except (OSError, IndexError):
        return "Z"


def test_block_bytes_are_a_function_of_the_key() -> None:
    k1, k2 = block_key(0, 1, 2, 3), block_key(0, 1, 2, 4)
    assert (block_bytes(k1, 4096) == block_bytes(k1, 4096)).all()
    assert not (block_bytes(k1, 4096) == block_bytes(k2, 4096)).all()
    assert block_bytes(k1, 100).shape == (100,)


def test_journals_merge_and_skip_a_line_cut_by_a_kill(tmp_path: Path) -> None:
    keys = [block_key(0, 0, 0, i) for i in range(3)]
    j = Journal(journal_path(tmp_path, 0, 0))
    j.acked(keys[:2])
    j.counts(OpCounts(puts=5, acked=2))
    j.wrong(keys[2])
    j.counts(OpCounts(puts=9, acked=2, wrong=1))
    j.close()
    j = Journal(journal_path(tmp_path, 1, 0))
    j.acked([keys[1], keys[2]])
    j.counts(OpCounts(puts=1))
    j.close()
    with open(journal_path(tmp_path, 1, 0), "a") as fh:
        fh.write('{"ev":"ack","keys":["00')  # the write kill -9 interrupted
    view = read_journals(tmp_path)
    assert view.acked == keys
    assert view.wrong == [keys[2]]
    assert view.counts == OpCounts(puts=10, acked=2, wrong=1)


def test_growth_fit_ignores_warmup_and_restart_drops() -> None:
    # two daemon lifetimes, each: a jump during warm-up, then +2 MB/min; the second starts lower
    samples = []
    for pid, t0, base in ((1, 0.0, 500e6), (2, 60.0, 200e6)):
        for i in range(121):
            t = t0 + i * 0.5
            warm = 100e6 if i < 4 else 0.0  # the first 2 s: below the cut
            samples.append(RssSample(t, pid, int(base + (t - t0) / 60 * 2e6 - warm), 0, 0))
    assert abs(growth_mb_per_min(samples, "vm_rss") - 2.0) < 1e-6
    assert growth_mb_per_min(samples[:3], "vm_rss") != growth_mb_per_min(samples[:3], "vm_rss")  # NaN: too few


def test_every_plan_kills_the_daemon_and_a_client_inside_the_run() -> None:
    for minutes in (0.05, 0.1, 1.0, 3.0):
        plan = SoakPlan(minutes=minutes, clients=2, seed=0)
        for seed in range(20):
            kills = plan.kills(random.Random(seed))
            kinds = [m.kind for m in kills]
            assert "daemon" in kinds and "client" in kinds
            assert all(0 < m.t < plan.seconds for m in kills)
            assert kills == sorted(kills, key=lambda m: m.t)
            assert all(m.t <= 0.7 * plan.seconds for m in kills if m.kind == "daemon")


def test_help_documents_the_soak_flags_and_bad_values_are_refused(capsys) -> None:  # noqa: ANN001 - pytest fixture
    import pytest

    from kvstore.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "soak", "--minutes", "0.25", "--clients", "3"])
    assert args.minutes == 0.25 and args.clients == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "soak: length of the run with kills, in minutes, fractions allowed" in help_text
    assert "soak: client processes" in help_text and "soak reliability:" in help_text
    for flag, value, message in (("--minutes", "0", "'0' must be a finite number above 0"),
                                 ("--minutes", "inf", "'inf' must be a finite number above 0"),
                                 ("--minutes", "two", "'two' is not a number"),
                                 ("--clients", "1.5", "'1.5' is not an integer"),
                                 ("--clients", "-1", "'-1' must be a finite number above 0")):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "soak", flag, value])
        assert f"argument {flag}: {message}" in capsys.readouterr().err
