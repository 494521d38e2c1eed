"""Markdown tables of a suite's figures and ratios (printed after a run, pasted into docs/BENCHMARKS.md)."""

from __future__ import annotations

import math
from typing import Any

from kvstore.bench.harness import Results


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if value == 0 or 0.01 <= abs(value) < 10_000:
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return f"{value:.3g}"


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def summary_markdown(results: Results) -> str:
    """Two markdown tables (figures, then ratios with targets), plus notes and skipped parts."""
    lines = [f"### {results.suite}", "", "| figure | parameters | value | unit |", "|---|---|---:|---|"]
    lines += [f"| {f.name} | {_params(f.params)} | {_fmt(f.value)} | {f.unit} |" for f in results.figures]
    if results.ratios:
        lines += ["", "| ratio | parameters | value | target | met |", "|---|---|---:|---:|---|"]
        for r in results.ratios:
            target = "" if r.target is None else f">= {r.target:g}"
            met = "" if r.met is None else ("yes" if r.met else "**no**")
            lines.append(f"| {r.name} | {_params(r.params)} | {_fmt(r.value)} | {target} | {met} |")
    for note in results.notes:
        lines.append(f"\n- note: {note}")
    for what, why in results.skipped.items():
        lines.append(f"\n- skipped {what}: {why}")
    return "\n".join(lines)
