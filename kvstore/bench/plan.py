"""Suite ``plan``: the capacity planner on every preset, with bandwidths measured in the same run.

Measures memcpy (host tier's limit) and raw direct reads (disk tier's limit)
on this machine, then plans each preset on a reference node (a GPU with
``GPU_KV`` bytes for KV, ``HOST`` bytes of host tier, ``DISK`` bytes of disk
tier): KV bytes per token, tokens per tier, and the time to load 4k, 32k and
128k-token prefixes from host and from disk.
"""

from __future__ import annotations

from pathlib import Path

from kvstore.bench.harness import Progress, Results, SuiteOptions, scratch_dir
from kvstore.bench.planner import PRESETS, make_plan
from kvstore.bench.plots import grid, grouped_bars, save
from kvstore.bench.rawio import direct_io_gbps, memcpy_gbps

GPU_KV = 40 << 30
HOST = 256 << 30
DISK = 2 << 40
PREFIXES = (4096, 32768, 131072)


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Measure the two bandwidths once, then plan every preset."""
    nbytes = (64 << 20) if options.quick else (512 << 20)
    results = Results("plan", options, {"gpu_kv_bytes": GPU_KV, "host_bytes": HOST, "disk_bytes": DISK,
                                        "prefix_tokens": list(PREFIXES), "measure_bytes": nbytes,
                                        "load_model": "bytes / bandwidth, no latency, no overlap"})
    progress.grow(2 + len(PRESETS))
    host_bw = memcpy_gbps(nbytes)
    results.add("bandwidth.host", host_bw, "GB/s", source="memcpy, measured")
    progress.step("memcpy")
    with scratch_dir(options) as tmp:
        raw = direct_io_gbps(tmp, nbytes)
    results.add("bandwidth.disk", raw.read_gbps, "GB/s", source=f"sequential read, {raw.mode}, measured")
    progress.step("direct I/O")
    for name, model in PRESETS.items():
        results.add("kv_bytes_per_token", model.bytes_per_token, "B/token", model=name)
        for prefix in PREFIXES:
            plan = make_plan(model, GPU_KV, HOST, DISK, host_bw, raw.read_gbps, prefix)
            for row in plan.rows():
                if prefix == PREFIXES[-1]:
                    results.add("tokens_fit", row["tokens"], "tokens", model=name, tier=row["tier"])  # type: ignore[arg-type]
                if row["bandwidth_GBps"] is not None:
                    results.add("prefix_load", float(row["prefix_load_s"]) * 1e3, "ms",  # type: ignore[arg-type]
                                model=name, tier=row["tier"], prefix_tokens=prefix)
        progress.step(name)
    return results


def plot(results: Results, path: Path) -> None:
    """Prefix load time from host and disk per preset (log scale), one panel per prefix length."""
    models = list(PRESETS)
    fig, axes = grid(len(PREFIXES), "Time to load a prefix into the GPU (measured bandwidths of this machine)")
    for ax, prefix in zip(axes, PREFIXES):
        series = {tier: [results.value("prefix_load", model=m, tier=tier, prefix_tokens=prefix) for m in models]
                  for tier in ("host", "disk")}
        grouped_bars(ax, models, series, "ms", f"{prefix:,}-token prefix")
        ax.set_yscale("log")
    save(fig, path)
