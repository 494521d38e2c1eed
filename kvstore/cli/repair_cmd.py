"""``kvstore repair``: move a damaged disk tier (LMDB environment or slab tier) aside, kept for inspection, and
start afresh."""

from __future__ import annotations

import argparse
import sys

from kvstore.errors import KVStoreError


def _run(args: argparse.Namespace) -> int:
    from kvstore.config import ConfigError, load_config  # here, not at the top: pydantic costs `kvstore --help` ~0.3 s
    from kvstore.tiers.lmdb.repair import repair_disk
    from kvstore.tiers.slab.repair import repair_slab

    try:
        cfg = load_config(args.config).for_role("daemon")  # the daemon's environment (``disk.path`` unset: its default)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tier = args.tier or ("slab" if "slab" in cfg.tiers else "lmdb")
    field, path = ("slab.path", cfg.slab.path) if tier == "slab" else ("disk.path", cfg.disk.path)
    disk, layout = cfg.disk, None
    if args.layout is not None:
        from kvstore.daemon.server.layout_dirs import read_layout_file, layout_section

        if cfg.daemon.layouts != "any" or tier != "lmdb":
            print(f"error: --layout names one layout's directory of a daemon with daemon.layouts: any and an lmdb "
                  f"tier; {args.config or 'the built-in defaults'} has daemon.layouts: {cfg.daemon.layouts}, tier "
                  f"{tier}", file=sys.stderr)
            return 2
        disk = layout_section(cfg.disk, args.layout)
        path = disk.path
        if args.salvage:  # the blocks are checked against their own layout, recorded beside them
            try:
                layout = read_layout_file(disk.directory())
            except ValueError as exc:
                print(f"error: --salvage: {exc}", file=sys.stderr)
                return 1
    try:
        if tier == "slab":
            report = repair_slab(cfg.slab, cfg.model.layout(), salvage=args.salvage)
        else:
            report = repair_disk(disk, layout or cfg.model.layout(), salvage=args.salvage)
    except KVStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if report.moved_to is None:
        print(f"kvstore repair: nothing at {field} {path}; the next start creates a fresh {tier} tier")
        return 0
    print(f"kvstore repair: moved {path} ({field}) aside to {report.moved_to} (kept for inspection)")
    if args.salvage:
        print(f"kvstore repair: salvaged {report.salvaged} blocks that verified into a fresh {path}; "
              f"{report.failed} could not be read or failed verification and were left behind")
        if report.walk_error:
            print(f"kvstore repair: note: {report.walk_error}")
    else:
        print(f"kvstore repair: the next start creates an empty {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``repair`` command."""
    parser = subparsers.add_parser(
        "repair",
        help="move a damaged disk tier (LMDB or slab) aside, keeping it, and start with a fresh one",
        description="For a disk tier the daemon refuses to open (truncated, not LMDB, damaged pages). Moves "
        "disk.path (the lmdb tier) or slab.path (the slab tier: its LMDB index and slots.dat) to "
        "<path>.damaged-<UTC time>, which is kept untouched for inspection, so the next start creates an empty "
        "tier. With --salvage, every block of the damaged tier that still verifies (checksum with its key, this "
        "config's model layout) is copied into the fresh one; a slab block whose index entry is lost cannot be "
        "salvaged. Refused while a daemon or another process has the directory open. Exit codes: 0 done, 1 "
        "refused or failed, 2 bad config.",
    )
    parser.add_argument("--tier", choices=["lmdb", "slab"], default=None,
                        help="which disk tier to repair (default: slab if the config's tiers name it, else lmdb)")
    parser.add_argument("--config", default=None, metavar="PATH",
                        help="the daemon's YAML config; its disk and model sections apply (default: $KVSTORE_CONFIG, else built-in "
                        "defaults; KVSTORE_* environment overrides apply)")
    parser.add_argument("--layout", default=None, metavar="NAME",
                        help="with daemon.layouts: any, repair one layout's LMDB, the directory NAME under "
                        "<disk.path>/layouts/ (the daemon's refusal names it); --salvage checks its blocks against "
                        "the layout recorded there")
    parser.add_argument("--salvage", action="store_true",
                        help="copy the blocks that still verify into the fresh environment (default: start empty)")
    parser.set_defaults(func=_run)
