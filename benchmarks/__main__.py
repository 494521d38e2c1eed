"""``python -m benchmarks SUITE``: run any benchmark suite, kvstore's own or one beside a peer's real code.

The same options as ``kvstore bench`` (one parser, :func:`kvstore.cli.bench_cmd.add_options`), plus the
real-vLLM ones.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import SUITE_HELP, SUITES
from kvstore.cli.bench_cmd import add_options, description, run
from kvstore.util.interrupts import Terminated, exit_status, sigterm_raises


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the suite; the exit status."""
    p = argparse.ArgumentParser(prog="python -m benchmarks", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description=description(SUITE_HELP, "\n\nRun from the checkout's root."))
    add_options(p, SUITES, checkout=True)
    args = p.parse_args(argv)
    try:
        with sigterm_raises():  # SIGTERM unwinds like Ctrl-C: peers' processes and scratch directories go
            return run(args, SUITES, "python -m benchmarks")
    except KeyboardInterrupt as exc:
        print("terminated" if isinstance(exc, Terminated) else "interrupted", file=sys.stderr)
        return exit_status(exc)


if __name__ == "__main__":
    sys.exit(main())
