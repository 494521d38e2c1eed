"""``kvstore stats``: read a running daemon's tiers, occupancy, hit rates and clients."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def format_stats(s: dict[str, Any], verbose: bool = False) -> str:
    """Human-readable summary of a STATS reply; ``verbose``: every field of each layout under its line (its
    label names only the model, dtype, block size and fingerprint start)."""
    from kvstore.config.units import format_size
    d, c = s["daemon"], s.get("counters")
    layouts = s.get("layouts", {})
    if d.get("model_id") is not None:
        serving = f"model {d['model_id']!r}, {d['bytes_per_block']} bytes/block"
    else:
        serving = f"any layout, {len(layouts)} of at most {d.get('max_layouts')} open"
    lines = [
        f"daemon pid {d['pid']}, up {d['uptime_s']:.0f} s, {serving}",
        f"listening: unix {d['socket_path']}, tcp {d['tcp'] or 'off'}, metrics {d['metrics_url'] or 'off'}",
        f"clients: {d['clients']} connected, {d['connections']} since start",
    ]
    if d.get("layouts_dormant"):
        lines.append(f"{d['layouts_dormant']} layouts closed with disk data ({format_size(d['dormant_disk_bytes'])}, "
                     "counted in disk.max_size): each opens when its next client logs in")
    if c is None:
        lines.append("no layout open yet: a layout's tiers open when its first client logs in")
        return "\n".join(lines)
    if d.get("model_id") is None:
        for label, lay in layouts.items():
            lc = lay["counters"]
            lines.append(f"layout {label}: {lay['bytes_per_block']} bytes/block, host {lay['host']['num_blocks']} blocks"
                         + (f", disk {lay['disk']['num_blocks']} blocks" if lay.get("disk") else "")
                         + f", {lc['host_hits'] + lc['disk_hits']} hits, {lc['host_misses']} host misses")
            if verbose:
                lines.append("  " + ", ".join(f"{k}={v}" for k, v in sorted(lay["layout"].items())))
    lines += [
        f"{'tier':<6}{'blocks':>10}{'used':>12}{'capacity':>12}{'occupancy':>11}{'hits':>10}{'misses':>10}"
        f"{'hit rate':>10}{'evicted':>9}{'corrupt':>9}",
    ]
    for tier in ("host", "disk"):
        t = s.get(tier)
        if not t:
            continue
        hits, misses = c[f"{tier}_hits"], c[f"{tier}_misses"]
        rate = f"{hits / (hits + misses):.1%}" if hits + misses else "-"
        occ = f"{t['used_bytes'] / t['capacity_bytes']:.1%}" if t["capacity_bytes"] else "-"
        lines.append(
            f"{tier:<6}{t['num_blocks']:>10}{format_size(t['used_bytes']):>12}{format_size(t['capacity_bytes']):>12}{occ:>11}"
            f"{hits:>10}{misses:>10}{rate:>10}{t['evictions']:>9}{t['corrupt_dropped']:>9}"
        )
    r = s.get("remote")
    if r:
        hits, misses = r["hits"], r["misses"]
        rate = f"{hits / (hits + misses):.1%}" if hits + misses else "-"
        occ = f"{r['used_bytes'] / r['capacity_bytes']:.1%}" if r["capacity_bytes"] else "-"
        lines.append(f"{'remote':<6}{'-':>10}{format_size(r['used_bytes']):>12}{format_size(r['capacity_bytes']):>12}"
                     f"{occ:>11}{hits:>10}{misses:>10}{rate:>10}{r['evictions']:>9}{r['corrupt_dropped']:>9}")
        link = r["link"]
        lines.append(f"remote ({link['write']}): {r['groups_stored']} groups stored, {link['loads_started']} blocks "
                     f"loaded ({link['loads_failed']} failed), {r['errors']} errors, {r['probe_timeouts']} probe "
                     f"timeouts; used/capacity are the whole server's")
    queried, hit = c["prefix_query_tokens"], c["prefix_hit_tokens"]
    lines.append(f"prefix cache: {hit} of {queried} tokens looked up were cached"
                 + (f" ({hit / queried:.1%})" if queried else "") + " (blocks x block size; as vLLM counts)")
    lines.append(f"host slot holds {s['holds']} (expired {s['holds_expired']}), pending disk writes {s['pending_writes']}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    from kvstore.config import ConfigError, load_config  # here, not at the top: pydantic costs `kvstore --help` ~0.3 s
    from kvstore.daemon.client.connection import DaemonClient, DaemonUnavailable
    from kvstore.daemon.wire.frames import DaemonError

    socket_path, token = args.socket, None
    if socket_path is None or args.config is not None:
        try:
            cfg = load_config(args.config)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        socket_path = socket_path or cfg.daemon.socket_path
        token = cfg.daemon.token
    client = DaemonClient(None, socket_path=socket_path, token=token, client_name="kvstore stats", use_shm=False)
    try:
        client.connect(args.wait)
        stats = client.stats()
    except (DaemonUnavailable, DaemonError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(stats, indent=2, sort_keys=True) if args.json else format_stats(stats, args.verbose))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``stats`` command."""
    parser = subparsers.add_parser(
        "stats",
        help="show a running daemon's tiers, occupancy, hit rates and clients",
        description="Connect to a running `kvstore serve` daemon (as an observer that needs no model layout) "
        "and print its statistics.",
    )
    parser.add_argument("--config", default=None, metavar="PATH",
                        help="config whose daemon.socket_path (and token) to use (default: $KVSTORE_CONFIG, else built-in defaults)")
    parser.add_argument("--socket", default=None, metavar="PATH", help="daemon socket path (overrides --config)")
    parser.add_argument("--json", action="store_true", help="print the raw statistics as JSON")
    parser.add_argument("--verbose", action="store_true",
                        help="every field of each layout (model id, layers, KV heads, head size, block size, dtype)")
    parser.add_argument("--wait", type=float, default=0.0, metavar="S",
                        help="keep retrying for up to S seconds while the daemon is not answering yet")
    parser.set_defaults(func=_run)
