"""The hitrate suite's report: the default configuration's two criteria (>= 0.55 of Belady at 2 % on the
held-out workloads; never below ``lru``) with exact ratios, margins, pass/fail per workload and the verdict;
and the choice of workloads and capacities (``--workloads``, ``--fractions``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvstore.bench import SUITES
from kvstore.bench.harness import Progress, Results, SuiteError, SuiteOptions
from kvstore.bench.hitrate import CRITERIA_FRACTION, DEFAULT_OF_BELADY, _default_criteria, run, workload_names
from kvstore.cli.bench_cmd import add_options


def _results(rows: list[tuple[str, str, float, float, float]], fraction: float = CRITERIA_FRACTION) -> Results:
    """Results holding, per ``(workload, role, belady, lru, default)``, the three hit rates at ``fraction``."""
    results = Results("hitrate", SuiteOptions(Path("unused")), {})
    for w, role, opt, lru, default in rows:
        p = {"workload": w, "role": role, "gpu_fraction": fraction, "gpu_blocks": 10}
        results.add("hit_rate.belady", opt, "fraction of prompt tokens", total_blocks=70, **p)
        results.add("hit_rate.lru", lru, "fraction of prompt tokens", **p)
        results.add("hit_rate.default", default, "fraction of prompt tokens", **p)
    return results


def _criterion(results: Results, name: str, workload: str) -> tuple[float, bool | None]:
    (r,) = [r for r in results.ratios if r.name == name and r.params["workload"] == workload]
    return r.value, r.met


def test_each_workload_is_judged_on_both_criteria_with_its_margin() -> None:
    results = _results([("drift", "held_out", 0.8, 0.6, 0.7),       # 0.875 of Belady, +10 points over lru
                        ("agent@seed1", "held_out", 0.5, 0.4, 0.39),  # 0.78 of Belady, 1 point below lru
                        ("scan-mix", "held_out", 0.4, 0.2, 0.2),      # 0.5 of Belady, level with lru
                        ("mooncake", "tuning", 0.5, 0.3, 0.25)])      # misses both, but is not held out
    _default_criteria(results, CRITERIA_FRACTION)

    assert _criterion(results, "criterion.default/belady", "drift") == (pytest.approx(0.875), True)
    assert _criterion(results, "criterion.default/lru", "drift") == (pytest.approx(0.7 / 0.6), True)
    assert _criterion(results, "criterion.default/belady", "agent@seed1") == (pytest.approx(0.78), True)
    assert _criterion(results, "criterion.default/lru", "agent@seed1") == (pytest.approx(0.39 / 0.4), False)
    assert _criterion(results, "criterion.default/belady", "scan-mix") == (pytest.approx(0.5), False)
    assert _criterion(results, "criterion.default/lru", "scan-mix") == (1.0, True)  # level with lru is not below it
    assert _criterion(results, "criterion.default/belady", "mooncake")[1] is False
    assert all(r.target == (DEFAULT_OF_BELADY if r.name.endswith("belady") else 1.0)
               for r in results.ratios)
    assert results.value("criterion.default/lru.margin", workload="agent@seed1") == pytest.approx(-1.0)
    assert results.value("criterion.default/belady.margin", workload="scan-mix") == pytest.approx(-0.05)
    # the verdict counts only the held-out workloads: mooncake's misses are reported, not judged
    assert results.notes == [
        "default at GPU 2%, >= 0.55 of Belady, 3 held-out workloads: FAIL on scan-mix (0.5000)",
        "default at GPU 2%, never below lru, 3 held-out workloads: FAIL on agent@seed1 (-1.0000 points)",
    ]


def test_a_pass_on_every_held_out_workload_says_pass() -> None:
    results = _results([("tenants", "held_out", 0.8, 0.6, 0.65), ("drift", "held_out", 0.8, 0.6, 0.7)])
    _default_criteria(results, CRITERIA_FRACTION)
    assert results.notes == ["default at GPU 2%, >= 0.55 of Belady, 2 held-out workloads: pass",
                             "default at GPU 2%, never below lru, 2 held-out workloads: pass"]


def test_a_run_without_the_criteria_capacity_says_it_did_not_judge() -> None:
    results = _results([("drift", "held_out", 0.8, 0.6, 0.7)], fraction=0.05)  # --quick replays 5 % and 20 %
    _default_criteria(results, CRITERIA_FRACTION)
    assert not results.ratios
    assert results.notes == ["default criteria not judged: no replay at GPU 2% (the full suite replays it)"]


def test_selected_workloads_and_fractions_are_all_that_is_replayed(tmp_path: Path) -> None:
    options = SuiteOptions(tmp_path, quick=True, workloads=("chat@seed1", "scan-mix"), fractions=(CRITERIA_FRACTION,))
    results = run(options, Progress("hitrate", 0, enabled=False))
    assert [f.params["workload"] for f in results.figures if f.name == "requests"] == ["scan-mix", "chat@seed1"]
    assert {f.params["gpu_fraction"] for f in results.figures if f.name == "hit_rate.default"} == {CRITERIA_FRACTION}
    left = [w for w in workload_names(0) if w not in ("chat@seed1", "scan-mix")]
    assert results.skipped == {"workloads": f"not selected (--workloads): {', '.join(left)}"}
    assert results.config["workloads"] == ["chat@seed1", "scan-mix"]
    assert results.config["fractions_of_footprint"] == [CRITERIA_FRACTION]
    assert {r.params["workload"] for r in results.ratios if r.name.startswith("criterion.")} == {"chat@seed1", "scan-mix"}
    assert len(results.notes) == 2 and all("2 held-out workloads" in n for n in results.notes)


def test_an_unknown_workload_fails_the_run_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(SuiteError, match=r"unknown workload chat@seed2; known: mooncake, chat, .*, agent@seed1$"):
        run(SuiteOptions(tmp_path, quick=True, workloads=("chat@seed2",)), Progress("hitrate", 0, enabled=False))


def test_the_cli_parses_workloads_and_fractions_and_refuses_bad_fractions() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_options(parser, SUITES, checkout=False)
    args = parser.parse_args(["hitrate", "--workloads", "mooncake,tenants", "--fractions", "0.01,0.02"])
    assert args.workloads == ("mooncake", "tenants") and args.fractions == (0.01, 0.02)
    defaults = parser.parse_args(["hitrate"])
    assert defaults.workloads is None and defaults.fractions is None
    for bad in ("0,0.02", "0.02,x", "1.5"):
        with pytest.raises(argparse.ArgumentError):
            parser.parse_args(["hitrate", "--fractions", bad])
