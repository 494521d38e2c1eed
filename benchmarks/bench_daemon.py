"""Get and put throughput through the sidecar daemon (shared memory) against the embedded tiers, as ratios.

For 1, 2 and 8 concurrent clients (by default) each client stores its own
``--blocks`` blocks and reads them back, in batches of ``--batch``:

- **embedded**: one process, one ``HostTier`` + ``DiskTier`` (LMDB), N threads.
  put = host put + disk put per batch, then one disk flush; get = host get.
- **daemon**: a ``kvstore serve`` subprocess and N client *processes* (engines
  are separate processes), each with a ``DaemonTier`` over shared memory.
  put = PUT_SHM_RESERVE, copy, PUT_SHM_COMMIT per batch, then FLUSH (the
  daemon's write-behind to LMDB drained and synced); get = the slot directory's lookup, copy
  and seqlock check, no request (protocol 5; the reads are reported with TOUCH_QUIET, no reply).
- **daemon, held** (the baseline: protocol 4's get, ``read_directory=False``): get = GET_SHM,
  copy, then the release deferred into the next GET_SHM's frame (GET_SHM_RELEASE).

Both put figures therefore cover "in host RAM and durable on disk". Each
setting runs ``--rounds`` rounds on fresh keys (the first warms up). Reported:
the best round's aggregate GB/s per side, ``ratio = daemon / embedded`` and
``held_ratio = daemon held / embedded``.
``--full-host`` sizes both host tiers for one round (x1.25), so every round
after the first evicts the previous one's blocks as it puts (a host tier's
steady state), and reports the best of those rounds only. Writes JSON to
``--out`` and a markdown table to stdout. Not a test: no assertion on speed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from kvstore.hashing import block_keys
from kvstore.layout import KVLayout

MODEL: dict[str, Any] = {"model_id": "bench-daemon", "num_layers": 4, "num_kv_heads": 4, "head_dim": 64,
                         "block_size": 16, "dtype": "float16"}  # 64 KiB per block


def _keys(client: int, n: int, layout: KVLayout) -> list[bytes]:
    return block_keys(list(range(n * layout.block_size)), layout, salt=f"client-{client}")


def _blocks(n: int, layout: KVLayout) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, 256, (layout.bytes_per_block,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _rounds(tier: Any, client: int, n: int, batch: int, layout: KVLayout, barrier: Any, flush: Any,
            rounds: int) -> list[dict[str, float]]:
    """:func:`_work` ``rounds`` times on fresh keys (the first round also warms caches and allocators up)."""
    return [_work(tier, client + 1000 * r, n, batch, layout, barrier, flush) for r in range(rounds)]


def _work(tier: Any, client: int, n: int, batch: int, layout: KVLayout, barrier: Any, flush: Any) -> dict[str, float]:
    """Put then get ``n`` blocks through ``tier``; returns start and end times of both phases."""
    keys, srcs = _keys(client, n, layout), _blocks(n, layout)
    dests = [torch.empty_like(s) for s in srcs]
    out: dict[str, float] = {}
    barrier.wait()
    out["put_start"] = time.perf_counter()
    for i in range(0, n, batch):
        if not all(tier.put(keys[i : i + batch], srcs[i : i + batch])):
            raise RuntimeError("put refused blocks: raise the host capacity")
    flush()
    out["put_end"] = time.perf_counter()
    barrier.wait()
    out["get_start"] = time.perf_counter()
    for i in range(0, n, batch):
        if not all(tier.get(keys[i : i + batch], dests[i : i + batch])):
            raise RuntimeError("get missed blocks")
    out["get_end"] = time.perf_counter()
    if not all(torch.equal(a, b) for a, b in zip(srcs, dests)):
        raise RuntimeError("blocks read back differ")
    return out


def _rate(times: list[dict[str, float]], op: str, total_bytes: int) -> float:
    start = min(t[f"{op}_start"] for t in times)
    end = max(t[f"{op}_end"] for t in times)
    return total_bytes / (end - start) / 1e9


def _best(per_client: list[list[dict[str, float]]], total_bytes: int, skip: int = 0) -> dict[str, float]:
    """Aggregate GB/s of each round over all clients; the best round per operation (the first ``skip`` left out)."""
    rounds = list(zip(*per_client))[skip:]
    return {f"{op}_gbps": max(_rate(list(r), op, total_bytes) for r in rounds) for op in ("put", "get")}


# ------------------------------------------------------------------ embedded
class _EmbeddedTiers:
    """Host tier in front of an LMDB tier in this process, written through synchronously."""

    def __init__(self, layout: KVLayout, capacity: int, disk_bytes: int, path: Path) -> None:
        from kvstore.tiers.lmdb.tier import DiskTier
        from kvstore.tiers.host.tier import HostTier

        self.host = HostTier(layout, capacity, pin_memory="never")
        self.disk = DiskTier(layout, path, disk_bytes, sync="interval")

    def put(self, keys: list[bytes], srcs: list[torch.Tensor]) -> list[bool]:
        ok = self.host.put(keys, srcs)
        self.disk.put(keys, srcs)
        return ok

    def get(self, keys: list[bytes], dests: list[torch.Tensor]) -> list[bool]:
        return self.host.get(keys, dests)


def host_capacity(clients: int, n: int, layout: KVLayout, rounds: int, full_host: bool) -> int:
    """Host tier bytes: every round's blocks (x1.25), or with ``full_host`` one round's, so later rounds evict."""
    return int((1 if full_host else rounds) * clients * n * layout.bytes_per_block * 1.25)


def run_embedded(clients: int, n: int, batch: int, layout: KVLayout, root: Path, rounds: int,
                 full_host: bool = False) -> dict[str, float]:
    tiers = _EmbeddedTiers(layout, host_capacity(clients, n, layout, rounds, full_host),
                           4 * host_capacity(clients, n, layout, rounds, False), root / f"emb-{clients}")
    barrier = threading.Barrier(clients)
    times: list[list[dict[str, float]]] = []
    errors: list[BaseException] = []

    def worker(c: int) -> None:
        try:
            times.append(_rounds(tiers, c, n, batch, layout, barrier, tiers.disk.flush, rounds))
        except BaseException as exc:  # reported after join
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tiers.disk.close()
    tiers.host.close()
    if errors:
        raise errors[0]
    return _best(times, clients * n * layout.bytes_per_block, skip=1 if full_host else 0)


# -------------------------------------------------------------------- daemon
def _daemon_client(socket_path: str, c: int, n: int, batch: int, rounds: int, barrier: Any, results: Any,
                   read_directory: bool) -> None:
    from kvstore.daemon.client.connection import DaemonClient
    from kvstore.daemon.client.tier import DaemonTier

    layout = KVLayout(**MODEL)
    client = DaemonClient(layout, socket_path=socket_path, client_name=f"bench {c}", read_directory=read_directory)
    client.connect(30)
    tier = DaemonTier(layout, client)
    try:
        results.put(_rounds(tier, c, n, batch, layout, barrier, tier.flush, rounds))
    except BaseException as exc:
        barrier.abort()
        results.put({"error": repr(exc)})
    finally:
        client.close()


def run_daemon(clients: int, n: int, batch: int, layout: KVLayout, root: Path, rounds: int,
               full_host: bool = False, read_directory: bool = True) -> dict[str, float]:
    """One daemon and ``clients`` client processes (``read_directory=False``: gets through GET_SHM)."""
    shutil.rmtree(root / f"lmdb-{clients}", ignore_errors=True)  # each run starts on an empty disk tier
    capacity = host_capacity(clients, n, layout, rounds, full_host)
    cfg = root / f"daemon-{clients}.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": MODEL, "host": {"capacity": capacity},
        "disk": {"path": str(root / f"lmdb-{clients}"), "max_size": 4 * host_capacity(clients, n, layout, rounds, False),
                 "sync": "interval"},
        "daemon": {"socket_path": str(root / f"d{clients}.sock")}, "metrics": {"enabled": False},
        "logging": {"level": "WARNING"},
    }))
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--config", str(cfg)],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if "listening on unix:" not in line:
            raise RuntimeError(f"daemon did not start: {line!r}")
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(clients), ctx.Queue()
        procs = [ctx.Process(target=_daemon_client, args=(str(root / f"d{clients}.sock"), c, n, batch, rounds, barrier, results,
                                                                   read_directory))
                 for c in range(clients)]
        for p in procs:
            p.start()
        times = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        bad = [t["error"] for t in times if isinstance(t, dict)]
        if bad:
            raise RuntimeError(f"daemon client failed: {bad[0]}")
    finally:
        proc.terminate()
        proc.wait(60)
    return _best(times, clients * n * layout.bytes_per_block, skip=1 if full_host else 0)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Embedded vs daemon GB/s per client count, one panel per operation, ratios in the labels."""
    from kvstore.bench.plots import grid, grouped_bars, save

    fig, axes = grid(2, "Daemon (shared memory) vs embedded tiers, 64 KiB blocks", ncols=2)
    for ax, op in zip(axes, ("put", "get")):
        mine = [r for r in rows if r["op"] == op]
        groups = [f"{r['clients']} client(s)\nratio {r['ratio']:.2f}" for r in mine]
        grouped_bars(ax, groups, {"embedded": [r["embedded_gbps"] for r in mine],
                                  "daemon": [r["daemon_gbps"] for r in mine],
                                  "daemon, held (GET_SHM)": [r["daemon_held_gbps"] for r in mine]}, "GB/s",
                     title=f"{op} ({'host RAM + durable on disk' if op == 'put' else 'from host RAM'})")
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,2,8", help="comma-separated client counts (default 1,2,8)")
    parser.add_argument("--blocks", type=int, default=512, help="blocks each client puts and gets (64 KiB each)")
    parser.add_argument("--batch", type=int, default=16, help="blocks per put/get call")
    parser.add_argument("--rounds", type=int, default=3, help="rounds on fresh keys per setting; the best is reported")
    parser.add_argument("--full-host", action="store_true",
                        help="host tiers hold one round (x1.25): later rounds evict as they put; report those only")
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="write the results as JSON here, and the plot next to it (same name, .png)")
    args = parser.parse_args(argv)
    layout = KVLayout(**MODEL)
    root = Path(tempfile.mkdtemp(prefix="kvbench", dir="/tmp"))
    rows: list[dict[str, Any]] = []
    try:
        for clients in [int(c) for c in args.clients.split(",")]:
            if args.full_host and args.rounds < 2:
                parser.error("--full-host needs --rounds 2 or more (the first round only fills the host tier)")
            emb = run_embedded(clients, args.blocks, args.batch, layout, root, args.rounds, args.full_host)
            dmn = run_daemon(clients, args.blocks, args.batch, layout, root, args.rounds, args.full_host)
            held = run_daemon(clients, args.blocks, args.batch, layout, root, args.rounds, args.full_host,
                              read_directory=False)
            for op in ("put", "get"):
                e, d, h = emb[f"{op}_gbps"], dmn[f"{op}_gbps"], held[f"{op}_gbps"]
                rows.append({"clients": clients, "op": op, "embedded_gbps": round(e, 3), "daemon_gbps": round(d, 3),
                             "ratio": round(d / e, 3), "daemon_held_gbps": round(h, 3), "held_ratio": round(h / e, 3)})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"schema": "kvstore-bench-daemon/2", "bytes_per_block": layout.bytes_per_block, "blocks_per_client":
              args.blocks, "batch": args.batch, "rounds": args.rounds, "full_host": args.full_host, "cpus": os.cpu_count(), "results": rows}
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        plot(rows, out.with_suffix(".png"))
    print("| clients | op | embedded GB/s | daemon GB/s | daemon / embedded | daemon held GB/s | held / embedded |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['op']} | {r['embedded_gbps']} | {r['daemon_gbps']} | {r['ratio']} | "
              f"{r['daemon_held_gbps']} | {r['held_ratio']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
