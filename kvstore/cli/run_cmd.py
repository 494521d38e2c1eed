"""``kvstore run``: start the service on a config (today: the store's smoke demo)."""

from __future__ import annotations

import argparse
import sys

from kvstore.config import ConfigError, load_config


def _run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from kvstore.smoke import run_smoke

    return run_smoke(cfg)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``run`` command."""
    parser = subparsers.add_parser(
        "run",
        help="start kvstore on a config (what `make run` calls)",
        description="Start kvstore with the given config. Until the daemon lands this runs the store's "
        "smoke demo: it caches a prompt's blocks and finds them again for a second prompt.",
    )
    parser.add_argument("--config", default=None, metavar="PATH", help="YAML config (default: built-in defaults)")
    parser.set_defaults(func=_run)
