"""``kvstore config check PATH`` and ``kvstore config default``."""

from __future__ import annotations

import argparse
import sys


def _check(args: argparse.Namespace) -> int:
    from kvstore.config import ConfigError, load_config  # here, not at the top: pydantic costs `kvstore --help` ~0.3 s
    from kvstore.config.render import render_default_yaml

    from kvstore.config.serve_checks import serve_problems
    from kvstore.config.units import decimal_size_notes

    try:
        cfg = load_config(args.path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problems = serve_problems(cfg, args.path) if args.use == "serve" else []
    for problem in problems:
        print(f"error: kvstore serve refuses it: {problem}", file=sys.stderr)
    if problems:
        return 2
    use = "kvstore serve" if args.use == "serve" else "an embedded store"
    print(f"# effective config of {args.path} (after KVSTORE_* environment overrides): OK for {use}")
    for note in decimal_size_notes(cfg):
        print(f"# note: {note}")
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
    check.add_argument("--for", dest="use", choices=["serve", "engine"], default="serve",
                       help="what reads it: `kvstore serve` (default; every check the daemon runs before it "
                       "starts) or an engine's embedded store (the engine gives the layout)")
    check.set_defaults(func=_check)
    default = sub.add_parser(
        "default",
        help="print the default config with every field documented",
        description="Print the built-in defaults as YAML with a comment on every field (the source of configs/default.yaml).",
    )
    default.set_defaults(func=_default)
