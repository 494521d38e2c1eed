"""Suite ``hitrate``: replayed workloads, kvstore's tiered hit rate (disk LRU, S3-FIFO, GDSF) vs GPU-only LRU and Belady.

For each workload and each GPU capacity ``G`` (a fraction of the
workload's distinct blocks, never below its largest request), these caches
replay the same requests:

- ``tiered_lru`` / ``tiered_s3fifo`` / ``tiered_gdsf``: kvstore's policy with
  ``G`` GPU, ``2G`` host (LRU) and ``4G`` disk blocks, the disk tier under
  ``disk.eviction: lru`` / ``s3fifo`` / ``gdsf``
  (:class:`~kvstore.bench.cache_sim.TieredCacheSim`, write_back, the tiers'
  own order classes);
- ``tiered_s3fifo_paper_ghost``: S3-FIFO with the paper's ghost size (as many
  keys as the main queue) instead of kvstore's 4 budgets, to show why;
- ``gpu_lru``: the same ``G`` GPU blocks and no lower tiers;
- ``belady``: the offline optimum for the total ``7G`` blocks
  (:mod:`kvstore.bench.belady`).

Hit rate = cached prompt tokens (full blocks of the matched prefix) / prompt
tokens. ``infinite`` is the ceiling (a cache that never evicts).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.bench.belady import belady_hits
from kvstore.bench.cache_sim import TieredCacheSim
from kvstore.bench.harness import Progress, Results, SuiteOptions
from kvstore.bench.mooncake import load_mooncake
from kvstore.bench.plots import grid, save
from kvstore.bench.workloads import GENERATORS, Trace, synthetic
from kvstore.tiers.eviction import EvictionOrder, make_order
from kvstore.tiers.s3fifo import S3FIFOIndex

HOST_PER_GPU = 2
DISK_PER_GPU = 4
FULL_FRACTIONS = (0.01, 0.02, 0.05, 0.1)
QUICK_FRACTIONS = (0.05, 0.2)
QUICK_TRACE_REQUESTS = 300
TARGET_OF_BELADY = 0.9
PAPER_GHOST = 0.9
"""The paper's ghost: as many keys as the main queue (1 - small fraction of the budget)."""

DISK_ORDERS: dict[str, Callable[[], EvictionOrder]] = {
    "tiered_lru": lambda: make_order("lru"),
    "tiered_s3fifo": lambda: make_order("s3fifo"),
    "tiered_s3fifo_paper_ghost": lambda: S3FIFOIndex(ghost_budgets=PAPER_GHOST),
    "tiered_gdsf": lambda: make_order("gdsf"),
}
"""Tiered variants by result name -> a new disk-tier order for one replay."""


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
    """Replay every workload at every capacity through every cache."""
    fractions = QUICK_FRACTIONS if options.quick else FULL_FRACTIONS
    results = Results("hitrate", options, {
        "fractions_of_footprint": list(fractions), "host_blocks_per_gpu_block": HOST_PER_GPU,
        "disk_blocks_per_gpu_block": DISK_PER_GPU, "write_policy": "write_back",
        "gpu_eviction": "radix LRU leaf (whole node)", "host_eviction": "block LRU (LRUIndex)",
        "disk_eviction": {"tiered_lru": "LRUIndex", "tiered_s3fifo": "S3FIFOIndex (ghost 4 budgets)",
                          "tiered_s3fifo_paper_ghost": f"S3FIFOIndex(ghost_budgets={PAPER_GHOST})",
                          "tiered_gdsf": "GDSFIndex (L + use count)"},
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
            p: dict[str, Any] = {"workload": w, "gpu_fraction": frac, "gpu_blocks": gpu}
            lru_sim = TieredCacheSim(gpu)
            lru = _rate(trace, [c.total for c in (lru_sim.request(r) for r in trace.requests)])
            opt = _rate(trace, belady_hits(trace.requests, gpu + host + disk))
            results.add("hit_rate.gpu_lru", lru, "fraction of prompt tokens", **p)
            results.add("hit_rate.belady", opt, "fraction of prompt tokens", total_blocks=gpu + host + disk, **p)
            rates: dict[str, float] = {}
            for name, new_order in DISK_ORDERS.items():
                t0 = time.perf_counter()
                sim = TieredCacheSim(gpu, host, disk, disk_policy=new_order())
                counts = [sim.request(r) for r in trace.requests]
                elapsed = time.perf_counter() - t0
                rates[name] = _rate(trace, [c.total for c in counts])
                results.add(f"hit_rate.{name}", rates[name], "fraction of prompt tokens", **p)
                for tier in ("gpu", "host", "disk"):
                    share = _rate(trace, [getattr(c, tier) for c in counts])
                    results.add(f"hit_rate.{name}.{tier}", share, "fraction of prompt tokens", **p)
                results.add(f"replay_time.{name}", elapsed / len(trace.requests) * 1e6, "us/request", **p)
                if name != "tiered_s3fifo_paper_ghost":
                    results.ratio(f"{name}/belady", rates[name], opt, TARGET_OF_BELADY, **p)
                    results.ratio(f"{name}/gpu_lru", rates[name], lru, **p)
            results.ratio("tiered_s3fifo/tiered_lru", rates["tiered_s3fifo"], rates["tiered_lru"], **p)
            results.ratio("tiered_gdsf/tiered_lru", rates["tiered_gdsf"], rates["tiered_lru"], **p)
            results.ratio("tiered_gdsf/tiered_s3fifo", rates["tiered_gdsf"], rates["tiered_s3fifo"], **p)
            progress.step(f"{w} gpu={frac:g}")
    return results


def plot(results: Results, path: Path) -> None:
    """One panel per workload: hit rate against GPU capacity for every cache and the ceiling."""
    workloads = list(dict.fromkeys(f.params["workload"] for f in results.figures if f.name == "hit_rate.tiered_lru"))
    fig, axes = grid(max(1, len(workloads)), "Prefix hit rate: kvstore tiered (G + 2G host LRU + 4G disk, disk LRU, "
                     "S3-FIFO or GDSF) vs GPU-only LRU (G) vs Belady (7G)")
    series = (("tiered_lru", "o-"), ("tiered_s3fifo", "D-"), ("tiered_s3fifo_paper_ghost", "x:"), ("tiered_gdsf", "v-"),
              ("gpu_lru", "s--"), ("belady", "^:"))
    for ax, w in zip(axes, workloads):
        for name, style in series:
            pts = [(f.params["gpu_fraction"], f.value) for f in results.figures
                   if f.name == f"hit_rate.{name}" and f.params["workload"] == w]
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=name.replace("_paper_ghost", " (paper ghost)"))
        ax.axhline(results.value("hit_rate.infinite", workload=w), color="grey", lw=0.8, label="infinite")
        ax.set_xscale("log")
        ax.set_xlabel("GPU capacity (fraction of distinct blocks)")
        ax.set_ylabel("hit rate (tokens)")
        ax.set_ylim(0, 1)
        ax.set_title(w, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, path)
