"""What every suite shares: options, the results record, the progress bar and ``results.json``.

``results.json`` (schema ``kvstore-bench/1``)::

    {"schema": "kvstore-bench/1", "suite": "tiers", "created": "2025-...Z",
     "command": "kvstore bench tiers --quick", "quick": true,
     "config": {...suite parameters...},
     "machine": {...see kvstore.bench.machine...},
     "figures": [{"name": "host.get", "value": 9.1, "unit": "GB/s",
                  "params": {"block_bytes": 1048576}}, ...],
     "ratios":  [{"name": "host.get/memcpy", "value": 0.83, "unit": "ratio",
                  "params": {...}, "target": 0.7, "met": true}, ...],
     "notes": ["..."], "skipped": {"what": "why"}, "plots": ["tiers.png"]}

Every number carries its unit; a ratio names its numerator and denominator.
Targets are recorded, never asserted.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

SCHEMA = "kvstore-bench/1"

Params = dict[str, Any]


@dataclass(frozen=True)
class SuiteOptions:
    """How a suite runs. Each suite reads the fields it needs."""

    out_dir: Path
    """Where ``results.json`` and the plot go (created if missing)."""
    quick: bool = False
    """Small sizes and few repetitions: seconds, for tests and smoke runs."""
    seed: int = 0
    """Seed of every synthetic workload and data generator."""
    trace: Path | None = None
    """Mooncake trace (``hitrate``); ``None`` or a missing file skips that workload."""
    trace_limit: int | None = None
    """Use only the first N requests of the trace."""
    data_dir: Path | None = None
    """Directory on the disk to measure (``tiers``); default: ``out_dir/data``."""
    command: str = ""
    """The command line that produced the run, recorded in the JSON."""
    minutes: float | None = None
    """Length of the ``soak`` run's main phase; ``None``: the suite's default (fractions allowed)."""
    clients: int | None = None
    """Client processes of the ``soak`` run; ``None``: the suite's default."""
    research: bool = False
    """``hitrate``: also replay the research variants (placement parameters no named policy stands for)."""
    workloads: tuple[str, ...] | None = None
    """``hitrate``: replay only these workloads, by the name results give them (``mooncake``, ``rag@seed1``);
    ``None``: every one."""
    fractions: tuple[float, ...] | None = None
    """``hitrate``: GPU capacities as fractions of each workload's distinct blocks; ``None``: the suite's default."""
    tenants: int | None = None
    """Tenants of the ``soak`` run's daemon, its clients taking turns among them and untenanted ones; ``None``: 0."""
    model: str | None = None
    """Engine model of the ``e2e`` suite, as ``kvstore generate --model`` takes it (``default``, ``builtin``,
    a path); ``None``: the suite's default (``default``; ``builtin`` with ``quick``)."""
    prefix_tokens: int | None = None
    """Shared prompt prefix of the ``e2e`` suite in tokens; ``None``: the suite's default."""
    repeats: int | None = None
    """Timed repeats of the ``e2e`` suite; ``None``: the suite's default."""
    replicas: str = "simulated"
    """``route``: ``simulated`` replicas (the trace replay) or two real ``vllm`` replicas (:mod:`benchmarks.route_vllm`)."""
    vllm_python: str | None = None
    """The ``vllm`` suite's Python with a vLLM that runs a model here; ``None``: ``.venv-vllm-cpu/bin/python``."""


class SuiteError(RuntimeError):
    """A suite cannot run (a missing model, sizes that do not fit) or measured something it must not report
    (cached output that differs from recompute); the message says what. The run fails with it."""


@dataclass(frozen=True)
class Figure:
    """One measured number with its unit and the parameters it was measured at."""

    name: str
    value: float
    unit: str
    params: Params = field(default_factory=dict)


@dataclass(frozen=True)
class Ratio:
    """kvstore's figure over its reference (a baseline or the machine's limit), and its target if any."""

    name: str
    value: float
    params: Params = field(default_factory=dict)
    target: float | None = None
    """Lowest acceptable ratio (from the issue); ``None`` when there is none."""
    unit: str = "ratio"

    @property
    def met(self) -> bool | None:
        """Whether the target is met; ``None`` without a target."""
        return None if self.target is None else self.value >= self.target


class Results:
    """What one suite run measured. Mutable while the suite runs; written once by :meth:`write`."""

    def __init__(self, suite: str, options: SuiteOptions, config: Params) -> None:
        self.suite = suite
        self.options = options
        self.config = dict(config)
        self.figures: list[Figure] = []
        self.ratios: list[Ratio] = []
        self.notes: list[str] = []
        self.skipped: dict[str, str] = {}
        self.plots: list[str] = []

    def add(self, name: str, value: float, unit: str, **params: Any) -> Figure:
        """Record a figure; returns it."""
        fig = Figure(name, float(value), unit, params)
        self.figures.append(fig)
        return fig

    def ratio(self, name: str, numerator: float, denominator: float, target: float | None = None,
              **params: Any) -> Ratio:
        """Record ``numerator / denominator`` (NaN when the denominator is 0); returns it."""
        value = numerator / denominator if denominator else math.nan
        r = Ratio(name, float(value), params, target)
        self.ratios.append(r)
        return r

    def note(self, text: str) -> None:
        """Record a remark for the reader (a fallback taken, a caveat)."""
        self.notes.append(text)

    def skip(self, what: str, why: str) -> None:
        """Record that part of the suite did not run, and why (also a note on stderr)."""
        self.skipped[what] = why
        tqdm.write(f"[{self.suite}] skipped {what}: {why}", file=sys.stderr)

    def value(self, name: str, **params: Any) -> float:
        """The first recorded figure called ``name`` whose params include ``params``."""
        for f in self.figures:
            if f.name == name and all(f.params.get(k) == v for k, v in params.items()):
                return f.value
        raise KeyError(f"no figure {name!r} with {params}")

    def to_json(self, machine: Params) -> Params:
        """The ``results.json`` document."""
        return {
            "schema": SCHEMA,
            "suite": self.suite,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": self.options.command,
            "quick": self.options.quick,
            "seed": self.options.seed,
            "config": self.config,
            "machine": machine,
            "figures": [asdict(f) for f in self.figures],
            "ratios": [{**asdict(r), "met": r.met} for r in self.ratios],
            "notes": self.notes,
            "skipped": self.skipped,
            "plots": self.plots,
        }

    def write(self, machine: Params) -> Path:
        """Write ``results.json`` into the output directory; returns its path."""
        out = self.options.out_dir
        out.mkdir(parents=True, exist_ok=True)
        path = out / "results.json"
        path.write_text(json.dumps(self.to_json(machine), indent=2, default=_jsonable) + "\n")
        return path


def _jsonable(obj: object) -> object:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


class Progress:
    """A tqdm bar on stderr over a suite's steps; suites call :meth:`step` after each unit of work."""

    def __init__(self, suite: str, total: int, enabled: bool = True) -> None:
        self._bar = tqdm(total=total, desc=f"bench {suite}", unit="step", file=sys.stderr,
                         disable=not enabled, dynamic_ncols=True, leave=True)

    def step(self, label: str = "", n: int = 1) -> None:
        """Advance by ``n`` steps and show ``label`` as the current activity."""
        if label:
            self._bar.set_postfix_str(label, refresh=False)
        self._bar.update(n)

    def grow(self, n: int) -> None:
        """Announce ``n`` more steps than first planned."""
        self._bar.total = (self._bar.total or 0) + n
        self._bar.refresh()

    def close(self) -> None:
        """Finish the bar."""
        self._bar.close()


def timeit(fn: Any, repeat: int, min_time: float = 0.0) -> float:
    """Best wall time of ``fn()`` in seconds over ``repeat`` runs (at least one, more until ``min_time``)."""
    best = math.inf
    start = time.perf_counter()
    runs = 0
    while runs < max(repeat, 1) or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best


@contextmanager
def scratch_dir(options: SuiteOptions) -> Iterator[Path]:
    """A fresh directory on the disk under test (``data_dir``, else ``out_dir``), removed afterwards."""
    parent = options.data_dir or options.out_dir
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=parent) as tmp:
        yield Path(tmp)
