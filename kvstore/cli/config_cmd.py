"""``kvstore config check PATH`` and ``kvstore config default``."""

from __future__ import annotations

import argparse
import sys


def _check(args: argparse.Namespace) -> int:
    from kvstore.config import ConfigError, load_config  # here, not at the top: pydantic costs `kvstore --help` ~0.3 s
    from kvstore.config.render import render_default_yaml

    try:
        cfg = load_config(args.path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"# effective config of {args.path} (after KVSTORE_* environment overrides): OK")
    print(render_default_yaml(cfg), end="")
    return 0


def _default(args: argparse.Namespace) -> int:
    from kvstore.config.render import render_default_yaml

    print(render_default_yaml(), end="")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``config`` command group."""
    parser = subparsers.add_parser(
        "config",
        help="validate or print configuration files",
        description="Validate a YAML config (`kvstore config check PATH`) or print the documented defaults "
        "(`kvstore config default`).",
    )
    sub = parser.add_subparsers(dest="config_command", metavar="ACTION")
    sub.required = True
    check = sub.add_parser(
        "check",
        help="validate a YAML config and print the effective config",
        description="Validate PATH, apply KVSTORE_<SECTION>__<FIELD> environment overrides and print the "
        "effective config. Exits 0 when valid, 2 with every problem listed when not.",
    )
    check.add_argument("path", metavar="PATH", help="YAML config file to validate")
    check.set_defaults(func=_check)
    default = sub.add_parser(
        "default",
        help="print the default config with every field documented",
        description="Print the built-in defaults as YAML with a comment on every field (the source of configs/default.yaml).",
    )
    default.set_defaults(func=_default)
