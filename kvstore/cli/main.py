"""``kvstore`` command line: one sub-command per module in this package.

Each sub-command module exposes ``register(subparsers)``, which adds its parser
and sets ``func`` (a callable taking the parsed namespace and returning an exit
code). Add a new command by writing its module and listing it in
``COMMAND_MODULES``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from kvstore.build_info import installed_version
from kvstore.util.interrupts import Terminated, exit_status, sigterm_raises

COMMAND_MODULES: tuple[str, ...] = (
    "kvstore.cli.config_cmd",
    "kvstore.cli.generate_cmd",
    "kvstore.cli.engine_cmd",
    "kvstore.cli.route_cmd",
    "kvstore.cli.demo_cmd",
    "kvstore.cli.bench_cmd",
    "kvstore.cli.plan_cmd",
    "kvstore.cli.serve_cmd",
    "kvstore.cli.stats_cmd",
    "kvstore.cli.repair_cmd",
)


class _VersionAction(argparse.Action):
    """``--version``: like argparse's ``version`` action, but looks the version up only when the flag is given."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        sys.stdout.write(f"{parser.prog} {installed_version()}\n")  # on stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="kvstore",
        description="Tiered KV-cache offload service for LLM inference (GPU pool, host RAM, LMDB on NVMe).",
    )
    parser.add_argument("--version", action=_VersionAction, help="print the installed version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstore`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # SIGTERM unwinds like Ctrl-C, so temporary directories and child processes are cleaned up
        # (``kvstore serve`` installs its own handlers: there SIGTERM means flush and stop).
        with sigterm_raises():
            code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away shows up here, not in the interpreter's exit-time flush
        return code
    except KeyboardInterrupt as exc:
        print("terminated" if isinstance(exc, Terminated) else "interrupted", file=sys.stderr)
        return exit_status(exc)
    except BrokenPipeError:
        # The reader closed the pipe (`kvstore ... | head -1`): stop quietly. Python's documented recipe:
        # point stdout at devnull so the exit-time flush cannot raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
