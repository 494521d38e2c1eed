"""``python -m benchmarks remote``: the Redis tier against raw redis-py and ``redis-benchmark`` on the same server,
and the Mooncake trace replayed by N processes sharing one Redis (hit rate with and without it).

Bandwidth: for each block size and group size, N blocks are stored (``put``) and read back (``get``)
through :class:`~kvstore.tiers.redis.tier.RedisTier`, against a raw redis-py pipeline of SET / GET of
values of the same size (no codec, no checksum) and ``redis-benchmark -P 16`` GET/SET of one value
size. All on one throwaway ``redis-server`` on loopback, started and stopped by pid.

Fleet replay: ``remote_replay`` workers (separate processes, each its own GPU pool and host tier)
take interleaved requests of the trace; one fleet with ``tiers: [host]`` and one with ``[host, remote]``
(its own fresh server) run at the same time; hit rate = blocks found in any tier / blocks requested.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvstore.bench.harness import Progress, Results, SuiteOptions, timeit
from benchmarks.redis_servers import RedisServer, redis_missing, start_server
from kvstore.config.remote import RemoteConfig
from kvstore.hashing import block_keys
from kvstore.layout import KVLayout

BLOCK_TOKENS = {65536: 8, 262144: 32, 1048576: 128}
"""Block bytes -> tokens per block of the layout below (2 layers x 8 KV heads x 128 dims x fp16, K and V)."""


def _layout(block_bytes: int) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, block_size=BLOCK_TOKENS[block_bytes],
                    dtype="float16", model_id="bench-remote")


def _bandwidth(server: RedisServer, results: Results, block_bytes: int, group: int, total: int, repeat: int) -> None:
    import redis

    from kvstore.tiers.redis.tier import RedisTier

    layout = _layout(block_bytes)
    n = max(group, (total // block_bytes) // group * group)
    gen = torch.Generator().manual_seed(block_bytes + group)
    blocks = [torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, generator=gen) for _ in range(n)]
    dests = [torch.empty(block_bytes, dtype=torch.uint8) for _ in range(n)]
    tier = RedisTier(layout, RemoteConfig(url=server.url, group_blocks=group, listen_evictions=False,
                                          max_inflight_bytes=max(64 << 20, 2 * group * block_bytes), timeout_s=30))
    raw = redis.Redis(port=server.port)
    run = [0]

    def chain() -> list[bytes]:
        run[0] += 1
        return block_keys(list(range(run[0] * 10**6, run[0] * 10**6 + n * layout.block_size)), layout)

    def put() -> None:
        assert all(tier.put(chain(), blocks))

    t_put = timeit(put, repeat)
    keys = chain()
    tier.put(keys, blocks)
    t_get = timeit(lambda: tier.get(keys, dests), repeat)
    assert torch.equal(dests[-1], blocks[-1])
    value = b"\x5a" * (group * block_bytes)
    values = n // group

    def raw_set() -> None:
        run[0] += 1
        pipe = raw.pipeline(transaction=False)
        for i in range(values):
            pipe.set(f"raw:{run[0]}:{i}", value)
        pipe.execute()

    t_raw_set = timeit(raw_set, repeat)
    pipe_keys = [f"raw:{run[0]}:{i}" for i in range(values)]

    def raw_get() -> None:
        pipe = raw.pipeline(transaction=False)
        for k in pipe_keys:
            pipe.get(k)
        pipe.execute()

    t_raw_get = timeit(raw_get, repeat)
    nbytes = n * block_bytes
    p = {"block_bytes": block_bytes, "group_blocks": group, "blocks": n}
    for name, t in (("remote.put", t_put), ("remote.get", t_get), ("raw_pipeline.set", t_raw_set),
                    ("raw_pipeline.get", t_raw_get)):
        results.add(name, nbytes / t / 1e9, "GB/s", **p)
    results.ratio("remote.get/raw_pipeline.get", t_raw_get, t_get, **p)
    results.ratio("remote.put/raw_pipeline.set", t_raw_set, t_put, **p)
    tier.close()
    raw.flushall()
    raw.close()


def _redis_benchmark(server: RedisServer, results: Results, value_bytes: int, requests: int) -> None:
    if shutil.which("redis-benchmark") is None:
        results.skip("redis-benchmark", "redis-benchmark not on PATH (Debian package redis-tools)")
        return
    out = subprocess.run(["redis-benchmark", "-p", str(server.port), "-t", "set,get", "-d", str(value_bytes),
                          "-n", str(requests), "-P", "16", "-c", "4", "--csv"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if len(cells) >= 2 and cells[0] in ("SET", "GET"):
            rps = float(cells[1])
            results.add(f"redis_benchmark.{cells[0].lower()}", rps * value_bytes / 1e9, "GB/s",
                        value_bytes=value_bytes, requests_per_s=rps)
    server.cli("FLUSHALL")


def _replay(results: Results, options: SuiteOptions, workers: int, limit: int, tmp: Path, progress: Progress) -> None:
    trace = options.trace
    if trace is None or not trace.exists():
        results.skip("fleet replay", f"Mooncake trace not found at {trace}")
        return
    configs = ("host", "host,remote")
    servers = [start_server(tmp / f"replay-{tiers.replace(',', '-')}") for tiers in configs]
    try:  # both fleets at once, so they run under the same machine load
        t0 = time.perf_counter()
        procs = {tiers: [subprocess.Popen([sys.executable, "-m", "benchmarks.remote_replay", str(w), str(workers),
                                           server.url, str(trace), str(limit), tiers],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          cwd=Path(__file__).resolve().parents[1])
                         for w in range(workers)]
                 for tiers, server in zip(configs, servers)}
        outs = {tiers: [p.communicate(timeout=1800) for p in ps] for tiers, ps in procs.items()}
        elapsed = time.perf_counter() - t0
    finally:
        for server in servers:
            server.stop()
    for tiers in configs:
        for proc, (out, err) in zip(procs[tiers], outs[tiers]):
            if proc.returncode != 0:
                raise RuntimeError(f"replay worker failed ({proc.returncode}): {err.strip()[-2000:]}")
        rows = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs[tiers]]
        blocks = sum(r["blocks"] for r in rows)
        hits = {t: sum(r["hit_blocks"][t] for r in rows) for t in ("gpu", "host", "remote")}
        label = "shared" if "remote" in tiers else "local_only"
        params = {"workers": workers, "requests": limit, "tiers": tiers}
        results.add(f"fleet.hit_rate.{label}", sum(hits.values()) / blocks if blocks else 0.0, "fraction of blocks",
                    **params)
        for t, v in hits.items():
            results.add(f"fleet.hit_rate.{label}.{t}", v / blocks if blocks else 0.0, "fraction of blocks", **params)
        results.add(f"fleet.remote_errors.{label}", sum(r["remote_errors"] for r in rows), "errors", **params)
        progress.step(f"replay {tiers}")
    results.add("fleet.replay_time", elapsed, "s", workers=workers, requests=limit)
    results.ratio("fleet.hit_rate.shared/local_only", results.value("fleet.hit_rate.shared"),
                  results.value("fleet.hit_rate.local_only"), workers=workers)


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Measure (see the module docstring)."""
    quick = options.quick
    sizes = [65536, 262144] if quick else [65536, 262144, 1048576]
    groups = [1, 4, 16] if not quick else [1, 8]
    total = (4 if quick else 128) << 20
    repeat = 1 if quick else 3
    workers = 2 if quick else 4
    limit = options.trace_limit or (40 if quick else 3000)
    results = Results("remote", options, {"block_bytes": sizes, "group_blocks": groups, "bytes_per_run": total,
                                          "repeat": repeat, "replay_workers": workers, "replay_requests": limit,
                                          "replay": {"gpu_blocks": 256, "host_blocks": 1024, "group_blocks": 4}})
    why = redis_missing()
    if why is not None:
        results.skip("everything", why)
        return results
    progress.grow(len(sizes) * len(groups) + 1 + 2)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-remote-") as d:
        tmp = Path(d)
        server = start_server(tmp / "bw")
        try:
            for size in sizes:
                for g in groups:
                    _bandwidth(server, results, size, g, total, repeat)
                    progress.step(f"{size >> 10} KiB x {g}")
            _redis_benchmark(server, results, 262144 * 8, 50 if quick else 2000)
            progress.step("redis-benchmark")
        finally:
            server.stop()
        _replay(results, options, workers, limit, tmp, progress)
    results.note("One redis-server on loopback on the same machine; the tier encodes (codec none) and checksums "
                 "every block, the raw pipeline sends opaque values of the same size.")
    return results


def plot(results: Results, path: Path) -> None:
    """Bandwidth by block and group size (tier vs raw pipeline), and the fleet hit rate."""
    from kvstore.bench.plots import grid, grouped_bars, save

    fig, axes = grid(3, "kvstore remote tier (Redis): bandwidth and shared-fleet hit rate", ncols=3)
    cases = sorted({(f.params["block_bytes"], f.params["group_blocks"]) for f in results.figures
                    if f.name == "remote.get"})
    labels = [f"{b >> 10}K x{g}" for b, g in cases]
    for ax, (op, raw_op) in zip(axes[:2], (("get", "get"), ("put", "set"))):
        series = {f"tier {op}": [results.value(f"remote.{op}", block_bytes=b, group_blocks=g) for b, g in cases],
                  f"raw pipeline {raw_op}": [results.value(f"raw_pipeline.{raw_op}", block_bytes=b, group_blocks=g)
                                             for b, g in cases]}
        grouped_bars(axes[axes.index(ax)], labels, series, "GB/s", f"{op} (block size x group)")
        for f in results.figures:
            if f.name == f"redis_benchmark.{raw_op}":
                ax.axhline(f.value, color="grey", ls="--", lw=0.8, label=f"redis-benchmark {raw_op}")
                ax.legend(fontsize=7)
    try:
        local, shared = results.value("fleet.hit_rate.local_only"), results.value("fleet.hit_rate.shared")
        grouped_bars(axes[2], ["local tiers only", "+ shared Redis"], {"hit rate": [local, shared]},
                     "fraction of blocks", "Mooncake trace, N processes")
        axes[2].set_ylim(0, 1)
    except KeyError:
        axes[2].set_visible(False)
    save(fig, path)
