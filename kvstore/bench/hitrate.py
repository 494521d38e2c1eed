"""Suite ``hitrate``: replayed workloads, kvstore's tiered hit rate beside GPU-only LRU and Belady.

For each workload and each GPU capacity ``G`` (a fraction of the
workload's distinct blocks, never below its largest request), three caches
replay the same requests:

- ``tiered``: kvstore's policy with ``G`` GPU, ``2G`` host and ``4G`` disk
  blocks (:class:`~kvstore.bench.cache_sim.TieredCacheSim`, write_back);
- ``gpu_lru``: the same ``G`` GPU blocks and no lower tiers;
- ``belady``: the offline optimum for the total ``7G`` blocks
  (:mod:`kvstore.bench.belady`).

Hit rate = cached prompt tokens (full blocks of the matched prefix) / prompt
tokens. ``infinite`` is the ceiling (a cache that never evicts).
"""

from __future__ import annotations

import time
from pathlib import Path

from kvstore.bench.belady import belady_hits
from kvstore.bench.cache_sim import TieredCacheSim
from kvstore.bench.harness import Progress, Results, SuiteOptions
from kvstore.bench.mooncake import load_mooncake
from kvstore.bench.plots import grid, save
from kvstore.bench.workloads import GENERATORS, Trace, synthetic

HOST_PER_GPU = 2
DISK_PER_GPU = 4
FULL_FRACTIONS = (0.01, 0.02, 0.05, 0.1)
QUICK_FRACTIONS = (0.05, 0.2)
QUICK_TRACE_REQUESTS = 300
TARGET_OF_BELADY = 0.9


def _rate(trace: Trace, hit_blocks: list[int]) -> float:
    return sum(hit_blocks) * trace.block_tokens / trace.prompt_tokens


def _workloads(options: SuiteOptions, results: Results) -> list[Trace]:
    traces = [synthetic(name, options.quick, options.seed) for name in GENERATORS]
    path = options.trace
    if path is None:
        results.skip("mooncake", "no trace path given (--trace)")
    elif not path.is_file():
        results.skip("mooncake", f"trace {path} not found")
    else:
        limit = options.trace_limit or (QUICK_TRACE_REQUESTS if options.quick else None)
        traces.append(load_mooncake(path, limit))
    return traces


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Replay every workload at every capacity through the three caches."""
    fractions = QUICK_FRACTIONS if options.quick else FULL_FRACTIONS
    results = Results("hitrate", options, {
        "fractions_of_footprint": list(fractions), "host_blocks_per_gpu_block": HOST_PER_GPU,
        "disk_blocks_per_gpu_block": DISK_PER_GPU, "write_policy": "write_back",
        "gpu_eviction": "radix LRU leaf (whole node)", "lower_tier_eviction": "block LRU",
        "belady": "block-level MIN with bypass over GPU+host+disk blocks, prefix-closed by (next use, depth) order",
        "trace": str(options.trace) if options.trace else None,
    })
    traces = _workloads(options, results)
    progress.grow(len(traces) * (len(fractions) + 1))
    for trace in traces:
        w = trace.name
        footprint = trace.footprint_blocks
        biggest = max(len(r.blocks) for r in trace.requests)
        results.add("requests", len(trace.requests), "requests", workload=w)
        results.add("footprint", footprint, "blocks", workload=w, block_tokens=trace.block_tokens)
        infinite = _rate(trace, belady_hits(trace.requests, footprint))
        results.add("hit_rate.infinite", infinite, "fraction of prompt tokens", workload=w)
        progress.step(f"{w} infinite")
        for frac in fractions:
            gpu = max(int(frac * footprint), biggest)
            host, disk = HOST_PER_GPU * gpu, DISK_PER_GPU * gpu
            p = {"workload": w, "gpu_fraction": frac, "gpu_blocks": gpu}
            t0 = time.perf_counter()
            sim = TieredCacheSim(gpu, host, disk)
            counts = [sim.request(r) for r in trace.requests]
            elapsed = time.perf_counter() - t0
            tiered = _rate(trace, [c.total for c in counts])
            lru_sim = TieredCacheSim(gpu)
            lru = _rate(trace, [c.total for c in (lru_sim.request(r) for r in trace.requests)])
            opt = _rate(trace, belady_hits(trace.requests, gpu + host + disk))
            results.add("hit_rate.tiered", tiered, "fraction of prompt tokens", **p)
            for tier in ("gpu", "host", "disk"):
                share = _rate(trace, [getattr(c, tier) for c in counts])
                results.add(f"hit_rate.tiered.{tier}", share, "fraction of prompt tokens", **p)
            results.add("hit_rate.gpu_lru", lru, "fraction of prompt tokens", **p)
            results.add("hit_rate.belady", opt, "fraction of prompt tokens", total_blocks=gpu + host + disk, **p)
            results.add("replay_time.tiered", elapsed / len(trace.requests) * 1e6, "us/request", **p)
            results.ratio("tiered/belady", tiered, opt, TARGET_OF_BELADY, **p)
            results.ratio("tiered/gpu_lru", tiered, lru, **p)
            progress.step(f"{w} gpu={frac:g}")
    return results


def plot(results: Results, path: Path) -> None:
    """One panel per workload: hit rate against GPU capacity for the three caches and the ceiling."""
    workloads = list(dict.fromkeys(f.params["workload"] for f in results.figures if f.name == "hit_rate.tiered"))
    fig, axes = grid(max(1, len(workloads)), "Prefix hit rate: kvstore tiered (G+2G host+4G disk) vs GPU-only LRU (G) "
                     "vs Belady (7G)")
    for ax, w in zip(axes, workloads):
        for name, style in (("tiered", "o-"), ("gpu_lru", "s--"), ("belady", "^:")):
            pts = [(f.params["gpu_fraction"], f.value) for f in results.figures
                   if f.name == f"hit_rate.{name}" and f.params["workload"] == w]
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=name)
        ax.axhline(results.value("hit_rate.infinite", workload=w), color="grey", lw=0.8, label="infinite")
        ax.set_xscale("log")
        ax.set_xlabel("GPU capacity (fraction of distinct blocks)")
        ax.set_ylabel("hit rate (tokens)")
        ax.set_ylim(0, 1)
        ax.set_title(w, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, path)
