"""``kvstore plan``: how many tokens of a model's KV cache fit in each tier, and how fast a prefix loads."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from kvstore.bench.planner import PRESETS, load_model, make_plan


def _size(text: str) -> int:
    """An argparse ``type``: a size with units, parsed as config files parse them."""
    # pydantic is imported only when a size is given: `kvstore --help` registers this command too
    from pydantic import TypeAdapter, ValidationError

    from kvstore.config.units import Size

    try:
        return int(TypeAdapter(Size).validate_python(text))
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 80GiB or 2TB ({exc.errors()[0]['msg']})")


def _measured_from(path: Path) -> tuple[float, float]:
    """Host get and cold LMDB get bandwidths (GB/s) at the largest block size of a ``tiers`` results.json."""
    doc = json.loads(path.read_text())
    figs = [f for f in doc.get("figures", []) if f.get("unit") == "GB/s"]

    def best(name: str) -> float:
        rows = [f for f in figs if f["name"] == name]
        if not rows:
            raise ValueError(f"{path}: no figure {name!r} (is it a tiers results.json?)")
        return max(rows, key=lambda f: f["params"].get("block_bytes", 0))["value"]

    return best("host.get"), best("lmdb.get_cold")


def _plan(args: argparse.Namespace) -> int:
    try:
        model = load_model(args.model)
        host_bw, disk_bw = args.host_bw, args.disk_bw
        if args.from_results is not None:
            measured = _measured_from(args.from_results)
            host_bw = host_bw or measured[0]
            disk_bw = disk_bw or measured[1]
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    source = f"from {args.from_results}" if args.from_results else "given"
    if host_bw is None or disk_bw is None:
        from kvstore.bench.rawio import direct_io_gbps, memcpy_gbps

        # Small samples (32 MiB each), so that a plan answers in under a second; `kvstore bench
        # tiers` measures the same limits on the tiers' own sizes.
        host_bw = host_bw or memcpy_gbps(32 << 20)
        with tempfile.TemporaryDirectory(dir=args.disk_path) as tmp:
            disk_bw = disk_bw or direct_io_gbps(Path(tmp), 32 << 20).read_gbps
        source = f"measured now (memcpy; direct reads under {args.disk_path or tempfile.gettempdir()})"
    plan = make_plan(model, args.gpu_mem, args.host_mem, args.disk_size, host_bw, disk_bw, args.prefix_tokens)
    if args.json:
        print(json.dumps({"model": model.name, "bytes_per_token": model.bytes_per_token,
                          "prefix_tokens": args.prefix_tokens, "tiers": plan.rows()}, indent=2))
    else:
        print(plan.render())
        print(f"\nbandwidths {source}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` command."""
    p = subparsers.add_parser(
        "plan", help="capacity planner: KV bytes per token, tokens per tier, prefix load time",
        description="Print the KV cache size per token of a model, how many tokens fit in the GPU, host and "
        "disk tiers, and how long a prefix takes to load from each tier. Bandwidths are given (--host-bw, "
        "--disk-bw), read from a `kvstore bench tiers` results.json (--from-results), or measured now.")
    p.add_argument("--model", required=True, metavar="PRESET_OR_CONFIG_JSON",
                   help=f"a preset ({', '.join(PRESETS)}) or the path of a Hugging Face config.json")
    p.add_argument("--gpu-mem", type=_size, default=0, metavar="SIZE",
                   help="GPU memory given to the KV cache, e.g. 40GiB (default 0)")
    p.add_argument("--host-mem", type=_size, default=0, metavar="SIZE",
                   help="host RAM given to the host tier, e.g. 256GiB (default 0)")
    p.add_argument("--disk-size", type=_size, default=0, metavar="SIZE",
                   help="disk given to the LMDB tier, e.g. 2TB (default 0)")
    p.add_argument("--prefix-tokens", type=int, default=131072, metavar="N",
                   help="prefix length whose load time is estimated (default 131072)")
    p.add_argument("--host-bw", type=float, default=None, metavar="GBPS",
                   help="host-to-GPU bandwidth in GB/s (default: --from-results or measured memcpy)")
    p.add_argument("--disk-bw", type=float, default=None, metavar="GBPS",
                   help="disk read bandwidth in GB/s (default: --from-results or measured direct reads)")
    p.add_argument("--from-results", type=Path, default=None, metavar="RESULTS_JSON",
                   help="take bandwidths from a `kvstore bench tiers` results.json (largest block size)")
    p.add_argument("--disk-path", type=Path, default=None, metavar="DIR",
                   help="directory on the disk to measure when --disk-bw is not known (default: the temp dir)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.set_defaults(func=_plan)
