"""``kvstore repair``: move a damaged LMDB environment aside (kept for inspection) and start afresh."""

from __future__ import annotations

import argparse
import sys

from kvstore.errors import KVStoreError


def _run(args: argparse.Namespace) -> int:
    from kvstore.config import ConfigError, load_config  # here, not at the top: pydantic costs `kvstore --help` ~0.3 s
    from kvstore.tiers.repair import repair_disk

    try:
        cfg = load_config(args.config).for_role("daemon")  # the daemon's environment (``disk.path`` unset: its default)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        report = repair_disk(cfg.disk, cfg.model.layout(), salvage=args.salvage)
    except KVStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if report.moved_to is None:
        print(f"kvstore repair: nothing at disk.path {cfg.disk.path}; the next start creates a fresh environment")
        return 0
    print(f"kvstore repair: moved {cfg.disk.path} aside to {report.moved_to} (kept for inspection)")
    if args.salvage:
        print(f"kvstore repair: salvaged {report.salvaged} blocks that verified into a fresh {cfg.disk.path}; "
              f"{report.failed} could not be read or failed verification and were left behind")
        if report.walk_error:
            print(f"kvstore repair: note: {report.walk_error}")
    else:
        print(f"kvstore repair: the next start creates an empty {cfg.disk.path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``repair`` command."""
    parser = subparsers.add_parser(
        "repair",
        help="move a damaged disk tier (LMDB) aside, keeping it, and start with a fresh one",
        description="For a disk tier the daemon refuses to open (truncated, not LMDB, damaged pages). Moves "
        "disk.path to <disk.path>.damaged-<UTC time>, which is kept untouched for inspection, so the next "
        "start creates an empty environment. With --salvage, every block of the damaged environment that "
        "still verifies (checksum with its key, this config's model layout) is copied into the fresh one. "
        "Refused while a daemon or another process has disk.path open. Exit codes: 0 done, 1 refused or "
        "failed, 2 bad config.",
    )
    parser.add_argument("--config", default=None, metavar="PATH",
                        help="the daemon's YAML config; its disk and model sections apply (default: $KVSTORE_CONFIG, else built-in "
                        "defaults; KVSTORE_* environment overrides apply)")
    parser.add_argument("--salvage", action="store_true",
                        help="copy the blocks that still verify into the fresh environment (default: start empty)")
    parser.set_defaults(func=_run)
