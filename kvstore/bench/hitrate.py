"""Suite ``hitrate``: every named placement policy (``policy.placement``) replayed through kvstore's tiers, against
the pooled online caches of the same total size, GPU-only LRU and Belady.

For each workload and each GPU capacity ``G`` (a fraction of the workload's distinct blocks, never below its
largest request), these caches replay the same requests:

- ``lru`` / ``s3fifo`` / ``gdsf`` / ``adaptive``: the store with ``G`` GPU, ``2G`` host and ``4G`` disk blocks
  under that named policy (:meth:`~kvstore.bench.cache_sim.TieredCacheSim.for_policy`: the policy's own
  orders and switches), ``write_back`` (so ``adaptive``'s tiers are exclusive);
- ``default``: the default configuration as shipped (``policy.placement`` and ``policy.write`` as
  :class:`~kvstore.config.schema.PolicyConfig` declares them: ``adaptive`` under ``write_back``, host and disk
  holding distinct blocks);
- ``adaptive_inclusive``: ``adaptive`` as it runs under ``write_through``, whose tiers hold copies of each
  other's blocks (replayed with write_back's flow, inclusive);
- ``pooled_lru`` / ``pooled_s3fifo`` / ``pooled_gdsf``: one flat cache of ``7G`` blocks, no tiers
  (:class:`~kvstore.bench.cache_sim.PooledCacheSim`): what an online cache of the same total size keeps;
- ``gpu_lru``: the same ``G`` GPU blocks and no lower tiers (SGLang's radix cache);
- ``belady``: the offline optimum for the total ``7G`` blocks (:mod:`kvstore.bench.belady`).

Workloads: the shared Mooncake trace and the synthetic families the policies' parameters were chosen on
(:data:`~kvstore.bench.workloads.GENERATORS`), then the held-out ones: three families written after the
named policies were fixed (:data:`~kvstore.bench.workloads.HELD_OUT_PLACEMENT`) and four earlier families
replayed with another seed (:data:`~kvstore.bench.workloads.OTHER_SEED_FAMILIES`).

The model is checked against the store itself: the first 600 Mooncake requests are replayed through a real
:class:`~kvstore.store.tiered.TieredStore` (GPU pool on the CPU, host tier, slab tier) under each named policy at
G = 1 and 2 % (:mod:`kvstore.bench.store_replay`), beside the model fed the store's own keys (so a duel
samples the same blocks), and the requests whose hits differ in any tier are counted (``store_check``).

With ``--research`` the suite also replays variants no named policy stands for (one order per tier,
switches one at a time), as parameters of the simulator, never config fields.

Hit rate = cached prompt tokens (full blocks of the matched prefix) / prompt tokens. ``infinite`` is the
ceiling (a cache that never evicts).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.bench.belady import belady_hits
from kvstore.bench.cache_sim import PooledCacheSim, TieredCacheSim
from kvstore.bench.harness import Progress, Results, SuiteOptions
from kvstore.bench.mooncake import load_mooncake
from kvstore.bench.plots import grid, save
from kvstore.bench.workloads import GENERATORS, HELD_OUT_PLACEMENT, OTHER_SEED_FAMILIES, Trace, synthetic
from kvstore.config.schema import PolicyConfig
from kvstore.policy.named import DEFAULT_PLACEMENT, POLICIES
from kvstore.policy.order import make_order
from kvstore.policy.s3fifo import S3FIFOIndex

HOST_PER_GPU = 2
DISK_PER_GPU = 4
FULL_FRACTIONS = (0.01, 0.02, 0.05, 0.1)
QUICK_FRACTIONS = (0.05, 0.2)
QUICK_TRACE_REQUESTS = 300
TARGET_OF_BELADY = 0.9
DEFAULT_OF_BELADY = 0.55
"""Issue 43's floor for the default configuration as shipped (and never below ``lru``)."""
PAPER_GHOST = 0.9
"""The paper's ghost: as many keys as the main queue (1 - small fraction of the budget)."""
POOLED_ORDERS = ("lru", "s3fifo", "gdsf")
"""Orders of the pooled online caches; ``pooled_best`` is the best of them per point."""

TieredFactory = Callable[[int, int, int], TieredCacheSim]

NAMED: dict[str, TieredFactory] = {
    **{name: (lambda p: lambda g, h, d: TieredCacheSim.for_policy(p, g, h, d, "write_back"))(policy)
       for name, policy in POLICIES.items()},
    "default": lambda g, h, d: TieredCacheSim.for_policy(POLICIES[PolicyConfig().placement], g, h, d, PolicyConfig().write),
    "adaptive_inclusive": lambda g, h, d: TieredCacheSim.for_policy(POLICIES["adaptive"], g, h, d, "write_through"),
}
"""The named policies by result name -> a new simulator of ``(gpu, host, disk)`` blocks for one replay."""

RESEARCH: dict[str, tuple[TieredFactory, str]] = {
    "disk_s3fifo_only": (lambda g, h, d: TieredCacheSim(g, h, d, disk_policy="s3fifo"), "host LRU, disk S3-FIFO"),
    "disk_s3fifo_paper_ghost": (lambda g, h, d: TieredCacheSim(g, h, d, disk_policy=S3FIFOIndex(ghost_budgets=PAPER_GHOST)),
                                f"host LRU, disk S3-FIFO with the paper's ghost ({PAPER_GHOST} budgets)"),
    "disk_gdsf_only": (lambda g, h, d: TieredCacheSim(g, h, d, disk_policy=make_order("gdsf")), "host LRU, disk GDSF"),
    "gdsf_exclusive": (lambda g, h, d: TieredCacheSim(g, h, d, disk_policy="gdsf", host_policy="gdsf", carry_uses=True,
                                                      exclusive=True), "gdsf, exclusive tiers"),
    "duel_per_tier": (lambda g, h, d: TieredCacheSim(g, h, d, disk_policy="duel", host_policy="duel", carry_uses=True,
                                                     exclusive=True, use_memory=4.0, gdsf_weight="damped"),
                      "adaptive with a duel per tier instead of one for both"),
    "adaptive_linear": (lambda g, h, d: TieredCacheSim(g, h, d, disk_policy="duel", host_policy="duel",
                                                       duel_scope="below_gpu", carry_uses=True, exclusive=True,
                                                       use_memory=4.0), "adaptive with GDSF's linear count weight"),
}
"""``--research``: variants by result name -> (simulator factory, what it changes)."""


def _rate(trace: Trace, hit_blocks: list[int]) -> float:
    return sum(hit_blocks) * trace.block_tokens / trace.prompt_tokens


def _workloads(options: SuiteOptions, results: Results) -> list[tuple[Trace, str]]:
    """``(trace, role)`` pairs: ``tuning`` (what the policies' parameters were chosen on) or ``held_out``."""
    out = [(synthetic(name, options.quick, options.seed), "held_out" if name in HELD_OUT_PLACEMENT else "tuning")
           for name in GENERATORS]
    out += [(synthetic(name, options.quick, options.seed + 1, label=f"{name}@seed{options.seed + 1}"), "held_out")
            for name in OTHER_SEED_FAMILIES]
    path = options.trace
    if path is None:
        results.skip("mooncake", "no trace path given (--trace)")
    elif not path.is_file():
        results.skip("mooncake", f"trace {path} not found")
    else:
        limit = options.trace_limit or (QUICK_TRACE_REQUESTS if options.quick else None)
        out.insert(0, (load_mooncake(path, limit), "tuning"))
    return out


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Replay every workload at every capacity through every cache."""
    fractions = QUICK_FRACTIONS if options.quick else FULL_FRACTIONS
    tiered = dict(NAMED)
    described = {name: POLICIES[name].summary for name in POLICIES}
    shipped = PolicyConfig()
    described["default"] = f"the default configuration as shipped: {shipped.placement} under {shipped.write}"
    described["adaptive_inclusive"] = "adaptive under write_through: tiers hold copies (inclusive)"
    if options.research:
        for name, (factory, what) in RESEARCH.items():
            tiered[name] = factory
            described[name] = what
    results = Results("hitrate", options, {
        "fractions_of_footprint": list(fractions), "host_blocks_per_gpu_block": HOST_PER_GPU,
        "disk_blocks_per_gpu_block": DISK_PER_GPU, "write_policy": "write_back (default: as shipped)",
        "gpu_eviction": "radix LRU leaf (whole node)", "policies": described, "default": DEFAULT_PLACEMENT,
        "pooled": f"one flat cache of 7G blocks under {', '.join(POOLED_ORDERS)}; pooled_best: the best of them",
        "belady": "block-level MIN with bypass over GPU+host+disk blocks, prefix-closed by (next use, depth) order",
        "trace": str(options.trace) if options.trace else None,
    })
    traces = _workloads(options, results)
    progress.grow(len(traces) * (len(fractions) + 1))
    for trace, role in traces:
        w = trace.name
        footprint = trace.footprint_blocks
        biggest = max(len(r.blocks) for r in trace.requests)
        results.add("requests", len(trace.requests), "requests", workload=w, role=role)
        results.add("footprint", footprint, "blocks", workload=w, block_tokens=trace.block_tokens)
        infinite = _rate(trace, belady_hits(trace.requests, footprint))
        results.add("hit_rate.infinite", infinite, "fraction of prompt tokens", workload=w)
        progress.step(f"{w} infinite")
        for frac in fractions:
            gpu = max(int(frac * footprint), biggest)
            host, disk = HOST_PER_GPU * gpu, DISK_PER_GPU * gpu
            p: dict[str, Any] = {"workload": w, "role": role, "gpu_fraction": frac, "gpu_blocks": gpu}
            lru_sim = TieredCacheSim(gpu)
            gpu_only = _rate(trace, [c.total for c in (lru_sim.request(r) for r in trace.requests)])
            opt = _rate(trace, belady_hits(trace.requests, gpu + host + disk))
            results.add("hit_rate.gpu_lru", gpu_only, "fraction of prompt tokens", **p)
            results.add("hit_rate.belady", opt, "fraction of prompt tokens", total_blocks=gpu + host + disk, **p)
            pooled = {}
            for order in POOLED_ORDERS:
                sim = PooledCacheSim(gpu + host + disk, order)
                pooled[order] = _rate(trace, [sim.request(r) for r in trace.requests])
                results.add(f"hit_rate.pooled_{order}", pooled[order], "fraction of prompt tokens", **p)
            best_pooled = max(pooled.values())
            results.add("hit_rate.pooled_best", best_pooled, "fraction of prompt tokens",
                        order=max(pooled, key=pooled.__getitem__), **p)
            rates: dict[str, float] = {}
            for name, new_sim in tiered.items():
                t0 = time.perf_counter()
                sim_t = new_sim(gpu, host, disk)
                counts = [sim_t.request(r) for r in trace.requests]
                elapsed = time.perf_counter() - t0
                rates[name] = _rate(trace, [c.total for c in counts])
                results.add(f"hit_rate.{name}", rates[name], "fraction of prompt tokens", **p)
                for tier in ("gpu", "host", "disk"):
                    share = _rate(trace, [getattr(c, tier) for c in counts])
                    results.add(f"hit_rate.{name}.{tier}", share, "fraction of prompt tokens", **p)
                results.add(f"replay_time.{name}", elapsed / len(trace.requests) * 1e6, "us/request", **p)
                results.ratio(f"{name}/belady", rates[name], opt,
                              DEFAULT_OF_BELADY if name == "default" else TARGET_OF_BELADY, **p)
                results.ratio(f"{name}/pooled_best", rates[name], best_pooled, **p)
                results.add(f"points_over_lru.{name}", 100 * (rates[name] - rates["lru"]), "points", **p)
            progress.step(f"{w} gpu={frac:g}")
    mooncake = [t for t, _ in traces if t.name == "mooncake"]
    if mooncake:
        _store_check(results, mooncake[0], options.quick, progress)
    _summary(results)
    return results


STORE_SAMPLE = 600
"""Mooncake requests replayed through the real store (``store_check``); 40 with ``--quick``."""
STORE_FRACTIONS = (0.01, 0.02)


def _store_check(results: Results, trace: Trace, quick: bool, progress: Progress) -> None:
    """Replay the first requests of ``trace`` through a real :class:`~kvstore.store.tiered.TieredStore` under each named
    policy (:mod:`kvstore.bench.store_replay`) and through the model, and report both per tier: how far the
    model's figures are from what the store keeps."""
    from kvstore.bench.store_replay import replay_store, serve

    sample = Trace(f"{trace.name}[:{STORE_SAMPLE}]", trace.block_tokens,
                   trace.requests[: 40 if quick else STORE_SAMPLE], trace.description)
    fractions = QUICK_FRACTIONS[:1] if quick else STORE_FRACTIONS
    progress.grow(len(fractions) * len(POLICIES))
    footprint = sample.footprint_blocks
    biggest = max(len(r.blocks) for r in sample.requests)
    for frac in fractions:
        gpu = max(int(frac * footprint), biggest)
        host, disk = HOST_PER_GPU * gpu, DISK_PER_GPU * gpu
        for name, policy in POLICIES.items():
            p: dict[str, Any] = {"workload": sample.name, "gpu_fraction": frac, "gpu_blocks": gpu, "policy": name}
            model = TieredCacheSim.for_policy(policy, gpu, host, disk, "write_back")
            t0 = time.perf_counter()
            with replay_store(policy, gpu, host, disk) as store:
                kept = [serve(store, r) for r in sample.requests]
                keys = [store.keys(r.blocks.tolist()) for r in sample.requests]
            results.add("store_check.replay_time", (time.perf_counter() - t0) / len(sample.requests) * 1e6,
                        "us/request", **p)
            modelled = [model.request(r, k) for r, k in zip(sample.requests, keys)]  # the store's keys: same sample
            results.add("store_check.requests_differing", sum(a != b for a, b in zip(modelled, kept)), "requests", **p)
            for tier in ("total", "gpu", "host", "disk"):
                def share(counts: list[Any]) -> float:
                    return _rate(sample, [getattr(c, tier) for c in counts])
                results.add(f"store_check.store.{tier}", share(kept), "fraction of prompt tokens", **p)
                results.add(f"store_check.model.{tier}", share(modelled), "fraction of prompt tokens", **p)
                results.add(f"store_check.points_model_minus_store.{tier}", 100 * (share(modelled) - share(kept)),
                            "points", **p)
            progress.step(f"store check {name} gpu={frac:g}")


def _summary(results: Results) -> None:
    """Per policy: its mean lead over ``lru`` on the held-out workloads, and its worst point against ``lru``
    anywhere (the targets: ahead on average, never more than 1 point behind)."""
    for name in (*NAMED, *RESEARCH):
        leads = [f for f in results.figures if f.name == f"points_over_lru.{name}"]
        if not leads:
            continue
        held = [f.value for f in leads if f.params["role"] == "held_out"]
        worst = min(leads, key=lambda f: f.value)
        if held:
            results.add(f"held_out.mean_points_over_lru.{name}", sum(held) / len(held), "points", points=len(held))
        results.add(f"worst_points_over_lru.{name}", worst.value, "points", workload=worst.params["workload"],
                    gpu_fraction=worst.params["gpu_fraction"])


def plot(results: Results, path: Path) -> None:
    """One panel per workload: hit rate against GPU capacity for every cache and the ceiling."""
    workloads = list(dict.fromkeys(f.params["workload"] for f in results.figures if f.name == "hit_rate.lru"))
    fig, axes = grid(max(1, len(workloads)), "Prefix hit rate: kvstore's named placement policies (G GPU + 2G host "
                     "+ 4G disk) vs pooled online caches (7G), GPU-only LRU (G) and Belady (7G)")
    series = (("lru", "o-"), ("s3fifo", "D-"), ("gdsf", "v-"), ("default", "X-"), ("adaptive_inclusive", "*:"),
              ("pooled_best", "P--"), ("gpu_lru", "s--"), ("belady", "^:"))
    for ax, w in zip(axes, workloads):
        for name, style in series:
            pts = [(f.params["gpu_fraction"], f.value) for f in results.figures
                   if f.name == f"hit_rate.{name}" and f.params["workload"] == w]
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=name)
        ax.axhline(results.value("hit_rate.infinite", workload=w), color="grey", lw=0.8, label="infinite")
        ax.set_xscale("log")
        ax.set_xlabel("GPU capacity (fraction of distinct blocks)")
        ax.set_ylabel("hit rate (tokens)")
        ax.set_ylim(0, 1)
        role = next(f.params["role"] for f in results.figures if f.name == "requests" and f.params["workload"] == w)
        ax.set_title(f"{w} ({role.replace('_', ' ')})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    save(fig, path)
