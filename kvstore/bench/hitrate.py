"""Suite ``hitrate``: replayed workloads, kvstore's tiered hit rate (disk LRU, S3-FIFO, GDSF; GDSF below the GPU) vs GPU-only LRU and Belady.

For each workload and each GPU capacity ``G`` (a fraction of the
workload's distinct blocks, never below its largest request), these caches
replay the same requests:

- ``tiered_lru`` / ``tiered_s3fifo`` / ``tiered_gdsf``: kvstore's policy with
  ``G`` GPU, ``2G`` host (LRU) and ``4G`` disk blocks, the disk tier under
  ``disk.eviction: lru`` / ``s3fifo`` / ``gdsf``
  (:class:`~kvstore.bench.cache_sim.TieredCacheSim`, write_back, the tiers'
  own order classes);
- ``tiered_gdsf_host``: GDSF on host and disk (``host.eviction: gdsf``) with
  use counts carried across tiers (``policy.carry_uses``), inclusive tiers;
- ``tiered_exclusive_gdsf``: the same with ``policy.exclusive_tiers`` (a
  loaded block leaves host and disk; GPU victims go to host, host victims to
  disk);
- ``tiered_exclusive_gdsf_mem``: the same with ``policy.use_memory: 4`` (the
  counts of blocks dropped from every tier are remembered, 4x the host +
  disk blocks of them, and resumed when a block comes back);
- ``tiered_exclusive_duel``: the same with ``disk.eviction: duel`` (GDSF or
  S3-FIFO chosen online, :class:`~kvstore.tiers.duel.DuelIndex`);
- ``tiered_exclusive_duel_shared``: the same with ``host.eviction: duel`` and
  ``policy.duel_scope: below_gpu`` (one duel for host and disk, scored on
  the hits of both, :func:`~kvstore.tiers.duel.shared_duel`);
- ``tiered_exclusive_duel_damped``: the same with ``policy.gdsf_weight:
  damped`` (GDSF priority ``L + min(count, 8) ** 0.8``,
  :data:`~kvstore.tiers.gdsf.DAMPED`);
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

TieredFactory = Callable[[int, int, int], TieredCacheSim]


def _disk_only(new_order: Callable[[], EvictionOrder]) -> TieredFactory:
    return lambda gpu, host, disk: TieredCacheSim(gpu, host, disk, disk_policy=new_order())


USE_MEMORY = 4.0
"""``policy.use_memory`` of ``tiered_exclusive_gdsf_mem``."""


def _gdsf_below(exclusive: bool, use_memory: float = 0.0, disk_policy: str = "gdsf", host_policy: str = "gdsf",
                duel_scope: str = "tier", gdsf_weight: str = "linear") -> TieredFactory:
    return lambda gpu, host, disk: TieredCacheSim(gpu, host, disk, disk_policy=disk_policy, host_policy=host_policy,
                                                  carry_uses=True, exclusive=exclusive, use_memory=use_memory,
                                                  duel_scope=duel_scope, gdsf_weight=gdsf_weight)


VARIANTS: dict[str, TieredFactory] = {
    "tiered_lru": _disk_only(lambda: make_order("lru")),
    "tiered_s3fifo": _disk_only(lambda: make_order("s3fifo")),
    "tiered_s3fifo_paper_ghost": _disk_only(lambda: S3FIFOIndex(ghost_budgets=PAPER_GHOST)),
    "tiered_gdsf": _disk_only(lambda: make_order("gdsf")),
    "tiered_gdsf_host": _gdsf_below(exclusive=False),
    "tiered_exclusive_gdsf": _gdsf_below(exclusive=True),
    "tiered_exclusive_gdsf_mem": _gdsf_below(exclusive=True, use_memory=USE_MEMORY),
    "tiered_exclusive_duel": _gdsf_below(exclusive=True, use_memory=USE_MEMORY, disk_policy="duel"),
    "tiered_exclusive_duel_shared": _gdsf_below(exclusive=True, use_memory=USE_MEMORY, disk_policy="duel",
                                                host_policy="duel", duel_scope="below_gpu"),
    "tiered_exclusive_duel_damped": _gdsf_below(exclusive=True, use_memory=USE_MEMORY, disk_policy="duel",
                                                host_policy="duel", duel_scope="below_gpu", gdsf_weight="damped"),
}
"""Tiered variants by result name -> a new simulator of ``(gpu, host, disk)`` blocks for one replay."""
VARIANT_CONFIG = {
    "tiered_lru": "disk.eviction: lru", "tiered_s3fifo": "disk.eviction: s3fifo (ghost 4 budgets)",
    "tiered_s3fifo_paper_ghost": f"disk.eviction: s3fifo, S3FIFOIndex(ghost_budgets={PAPER_GHOST})",
    "tiered_gdsf": "disk.eviction: gdsf",
    "tiered_gdsf_host": "host.eviction: gdsf, disk.eviction: gdsf, policy.carry_uses: true",
    "tiered_exclusive_gdsf": "host.eviction: gdsf, disk.eviction: gdsf, policy.carry_uses: true, "
                             "policy.exclusive_tiers: true",
    "tiered_exclusive_gdsf_mem": "host.eviction: gdsf, disk.eviction: gdsf, policy.carry_uses: true, "
                                 f"policy.exclusive_tiers: true, policy.use_memory: {USE_MEMORY:g}",
    "tiered_exclusive_duel": "host.eviction: gdsf, disk.eviction: duel, policy.carry_uses: true, "
                             f"policy.exclusive_tiers: true, policy.use_memory: {USE_MEMORY:g}",
    "tiered_exclusive_duel_shared": "host.eviction: duel, disk.eviction: duel, policy.duel_scope: below_gpu, "
                                    "policy.carry_uses: true, policy.exclusive_tiers: true, "
                                    f"policy.use_memory: {USE_MEMORY:g}",
    "tiered_exclusive_duel_damped": "host.eviction: duel, disk.eviction: duel, policy.duel_scope: below_gpu, "
                                    "policy.gdsf_weight: damped, policy.carry_uses: true, "
                                    f"policy.exclusive_tiers: true, policy.use_memory: {USE_MEMORY:g}",
}
"""What each variant sets (the rest is the default config, ``write: write_back``)."""
COMPARED = ("tiered_gdsf", "tiered_gdsf_host", "tiered_exclusive_gdsf", "tiered_exclusive_gdsf_mem",
            "tiered_exclusive_duel", "tiered_exclusive_duel_shared", "tiered_exclusive_duel_damped")
"""Variants reported against tiered LRU and S3-FIFO."""


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
        "gpu_eviction": "radix LRU leaf (whole node)", "variants": VARIANT_CONFIG,
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
            for name, new_sim in VARIANTS.items():
                t0 = time.perf_counter()
                sim = new_sim(gpu, host, disk)
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
            for name in COMPARED:
                results.ratio(f"{name}/tiered_lru", rates[name], rates["tiered_lru"], **p)
                results.ratio(f"{name}/tiered_s3fifo", rates[name], rates["tiered_s3fifo"], **p)
            progress.step(f"{w} gpu={frac:g}")
    return results


def plot(results: Results, path: Path) -> None:
    """One panel per workload: hit rate against GPU capacity for every cache and the ceiling."""
    workloads = list(dict.fromkeys(f.params["workload"] for f in results.figures if f.name == "hit_rate.tiered_lru"))
    fig, axes = grid(max(1, len(workloads)), "Prefix hit rate: kvstore tiered (G + 2G host + 4G disk; disk LRU, "
                     "S3-FIFO or GDSF; GDSF on host too, inclusive or exclusive) vs GPU-only LRU (G) vs Belady (7G)")
    series = (("tiered_lru", "o-"), ("tiered_s3fifo", "D-"), ("tiered_s3fifo_paper_ghost", "x:"), ("tiered_gdsf", "v-"),
              ("tiered_gdsf_host", "<-"), ("tiered_exclusive_gdsf", "*-"), ("tiered_exclusive_gdsf_mem", "P-"),
              ("tiered_exclusive_duel", "X-"), ("tiered_exclusive_duel_shared", "h-"),
              ("tiered_exclusive_duel_damped", "d-"),
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
