"""Run one suite end to end: measure, plot, write ``results.json``, print a summary.

A suite module exposes two functions:

- ``run(options: SuiteOptions, progress: Progress) -> Results`` measures;
  it announces its steps with ``progress.grow`` and advances with
  ``progress.step``.
- ``plot(results: Results, path: Path) -> None`` draws the suite's PNG.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from kvstore.bench import SUITES
from kvstore.bench.harness import Progress, SuiteOptions
from kvstore.bench.machine import describe_machine
from kvstore.bench.report import summary_markdown


def load_suite(name: str, suites: Mapping[str, str] = SUITES) -> ModuleType:
    """The module of suite ``name`` in ``suites`` (name -> module); ``ValueError`` naming the known suites when unknown."""
    try:
        return importlib.import_module(suites[name])
    except KeyError:
        raise ValueError(f"unknown suite {name!r}; known suites: {', '.join(suites)}") from None


def run_suite(name: str, options: SuiteOptions, show_progress: bool = True,
              suites: Mapping[str, str] = SUITES) -> Path:
    """Run suite ``name`` of ``suites`` (kvstore's own by default; the checkout's ``benchmarks`` adds the peers');
    writes ``results.json`` and ``NAME.png`` under ``options.out_dir``.

    Returns the path of ``results.json``. Prints a markdown summary of the
    figures and ratios on stdout.
    """
    module = load_suite(name, suites)
    progress = Progress(name, 0, enabled=show_progress)
    try:
        results = module.run(options, progress)
    finally:
        progress.close()
    options.out_dir.mkdir(parents=True, exist_ok=True)
    png = options.out_dir / f"{name}.png"
    module.plot(results, png)
    results.plots.append(png.name)
    path = results.write(describe_machine(options.data_dir or options.out_dir))
    sys.stdout.write(summary_markdown(results) + "\n")
    sys.stdout.write(f"wrote {path} and {png}\n")
    return path
