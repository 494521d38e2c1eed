"""Suite ``route``: KV-cache-aware routing on the Mooncake conversation trace, against N simulated replicas.

Each replica is a real kvstore cache (:mod:`kvstore.bench.route_sim`: the radix index with LRU leaf
eviction on ``gpu_blocks``, optionally a host tier) with modelled prefill and decode time; the
trace is replayed in trace time (:mod:`kvstore.bench.route_replay`) under each router of
:mod:`kvstore.bench.route_policies`:

- ``round_robin``;
- ``approx_tree``: SGLang's cache-aware policy with its gateway's defaults;
- ``kvstore``: the replicas' KV events through :class:`~kvstore.route.index.RouterIndex` and
  :class:`~kvstore.route.policy.CostPolicy` at its default load weight (a queued token costs
  ``DEFAULT_LOAD_WEIGHT`` of an uncached one);
- ``kvstore_ttft_greedy``, ``kvstore_w0.1``, ``kvstore_w0.02``: the same at load weight 1 (cost = the
  estimated time to first token), 0.1 and 0.02;
- ``exact_prefix``: the same index with no load term (what the issue warns about).

Figures: hit rate (prompt tokens served from a replica's cache), TTFT mean and p90, each replica's
share of requests, decision latency p99 (CPU time and wall time), and the router's event ingest
rate: in the replay (msgpack decode + index apply) and over real ZMQ on loopback (publisher ->
subscriber, :func:`zmq_ingest`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.harness import Progress, Results, SuiteError, SuiteOptions
from kvstore.bench.mooncake import BLOCK_TOKENS, load_mooncake, load_mooncake_timing
from kvstore.bench.plots import grid, save
from kvstore.bench.route_policies import (
    SGLANG_BALANCE_ABS,
    SGLANG_BALANCE_REL,
    SGLANG_CACHE_THRESHOLD,
    ApproxTree,
    KVStoreRouter,
    RoundRobin,
)
from kvstore.bench.route_replay import ReplayResult, Router, replay
from kvstore.bench.route_sim import ReplicaModel
from kvstore.route.policy import DEFAULT_LOAD_WEIGHT, CostPolicy

REPLICAS = 4
LOAD_WEIGHTS: dict[str, float] = {"kvstore": DEFAULT_LOAD_WEIGHT, "kvstore_ttft_greedy": 1.0, "kvstore_w0.1": 0.1,
                                   "kvstore_w0.02": 0.02, "exact_prefix": 0.0}
"""kvstore's policy at its default load weight and the sweep around it (the ``gpu`` scenario): a queued prefill
token costs that fraction of an uncached prompt token; 1 is the plain TTFT estimate, 0 no load term at all."""
EVENT_LAG_S = 0.05
"""From a prefill's end to its events reaching the router (the publisher's drain interval)."""
ISSUE_REFERENCE = {"round_robin": (0.103, 1.26), "approx_tree": (0.169, 1.54), "exact_prefix_plus_load": (0.179, 1.23)}
"""The issue's prior simulation (4 replicas; hit rate, mean TTFT s): another model, quoted for context."""

SCENARIOS: dict[str, tuple[int, int]] = {"gpu": (3000, 0), "gpu+host": (3000, 6000)}
"""Per replica (GPU blocks, host blocks) of 512 tokens: 1.5M tokens of GPU KV, and twice that in host RAM."""
QUICK_SCENARIOS: dict[str, tuple[int, int]] = {"gpu": (150, 0), "gpu+host": (150, 300)}
QUICK_REQUESTS = 200

POLICIES = ("round_robin", "approx_tree", *LOAD_WEIGHTS)
HOST_POLICIES = ("round_robin", "approx_tree", "kvstore")
"""Run in the ``gpu+host`` scenario (the sweep of load weights is the ``gpu`` scenario's)."""


def _router(policy: str, model: ReplicaModel) -> Any:
    bt = model.block_tokens
    tiers = {"gpu": 0.0, "host": model.prefill_tokens_per_s / model.host_load_tokens_per_s, "disk": 0.2,
             "remote": 0.3}

    def make(names: list[str]) -> Router:
        if policy == "round_robin":
            return RoundRobin(names)
        if policy == "approx_tree":
            return ApproxTree(names, bt)
        return KVStoreRouter(names, CostPolicy.for_block_size(bt, LOAD_WEIGHTS[policy], tiers), bt)

    return make


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Replay the trace under every router in every scenario; measure ZMQ ingest. (Real vLLM replicas are the
    checkout's: ``python -m benchmarks route --replicas vllm``.)"""
    if options.trace is None or not options.trace.is_file():
        raise SuiteError(f"the route suite needs the Mooncake trace; {options.trace} is not a file (--trace PATH)")
    limit = options.trace_limit or (QUICK_REQUESTS if options.quick else None)
    trace = load_mooncake(options.trace, limit)
    arrivals, outputs = load_mooncake_timing(options.trace, limit)
    scenarios = QUICK_SCENARIOS if options.quick else SCENARIOS
    base = ReplicaModel(0, 0, BLOCK_TOKENS)
    results = Results("route", options, {
        "trace": str(options.trace), "requests": len(trace.requests), "replicas": REPLICAS,
        "block_tokens": BLOCK_TOKENS, "scenarios": {k: {"gpu_blocks": g, "host_blocks": h} for k, (g, h) in scenarios.items()},
        "prefill_tokens_per_s": base.prefill_tokens_per_s, "host_load_tokens_per_s": base.host_load_tokens_per_s,
        "overhead_s": base.overhead_s, "decode_s_per_token": base.decode_s_per_token, "event_lag_s": EVENT_LAG_S,
        "kvstore_load_weights": LOAD_WEIGHTS,
        "approx_tree": {"cache_threshold": SGLANG_CACHE_THRESHOLD, "balance_abs_threshold": SGLANG_BALANCE_ABS,
                        "balance_rel_threshold": SGLANG_BALANCE_REL, "load": "in-flight requests"},
        "issue_reference": ISSUE_REFERENCE,
    })
    runs = [(s, p) for s in scenarios for p in (POLICIES if s == "gpu" else HOST_POLICIES)]
    progress.grow(len(runs) + 1)
    names = [f"r{i}" for i in range(REPLICAS)]
    for scenario, policy in runs:
        gpu, host = scenarios[scenario]
        model = ReplicaModel(gpu, host, BLOCK_TOKENS)
        router_holder: dict[str, Any] = {}
        make = _router(policy, model)

        def keep(ns: list[str], make: Any = make, holder: dict[str, Any] = router_holder) -> Router:
            holder["router"] = make(ns)
            return holder["router"]

        res = replay(trace.requests, arrivals, outputs, names, model, keep, EVENT_LAG_S)
        _record(results, res, router_holder["router"], scenario=scenario, policy=policy)
        progress.step(f"{scenario} {policy}")
    for scenario in scenarios:
        for metric in ("ttft_mean", "hit_rate"):
            ours = results.value(metric, policy="kvstore", scenario=scenario)
            for other in ("approx_tree", "round_robin"):
                results.ratio(f"{metric}.kvstore/{other}", ours, results.value(metric, policy=other, scenario=scenario),
                              scenario=scenario)
    batches = 200 if options.quick else 5000
    rate, lost = zmq_ingest(batches, 32)
    results.add("event_ingest.zmq", rate, "events/s", batches=batches, events_per_batch=32, lost_batches=lost)
    progress.step("zmq ingest")
    results.note("Simulated replicas: real kvstore caches, modelled time (see config). The issue's figures come "
                 "from another simulation; compare the policies of one run with each other.")
    return results


def _record(results: Results, res: ReplayResult, router: Any, **p: Any) -> None:
    results.add("hit_rate", res.hit_rate, "fraction of prompt tokens", **p)
    results.add("ttft_mean", float(res.ttft_s.mean()), "s", **p)
    results.add("ttft_p90", float(np.percentile(res.ttft_s, 90)), "s", **p)
    total = sum(res.requests_per_replica.values())
    for name, n in res.requests_per_replica.items():
        results.add("request_share", n / total, "fraction of requests", replica=name, **p)
    results.add("request_share_max_over_mean", max(res.requests_per_replica.values()) * len(res.requests_per_replica)
                / total, "ratio", **p)
    results.add("decision_p99_cpu", float(np.percentile(res.decision_cpu_s, 99)) * 1e6, "us", **p)
    results.add("decision_p99_wall", float(np.percentile(res.decision_s, 99)) * 1e6, "us", **p)
    if isinstance(router, KVStoreRouter) and router.ingest_s > 0:
        results.add("event_ingest.replay", router.events / router.ingest_s, "events/s", events=router.events, **p)


def zmq_ingest(batches: int, events_per_batch: int) -> tuple[float, int]:
    """Events per second from an :class:`EventPublisher` to an :class:`EventSubscriber` over loopback TCP
    (encode, send, receive, decode, apply), and the batches the subscriber saw missing (then replayed)."""
    from kvstore.events import StoreEvent
    from kvstore.route.index import RouterIndex
    from kvstore.route.publisher import EventPublisher
    from kvstore.route.subscriber import EventSubscriber, ReplicaEndpoints

    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "bench", buffer_batches=batches)
    sub = EventSubscriber(RouterIndex(), {"bench": ReplicaEndpoints(pub.endpoint, pub.replay_endpoint)})
    sub.start()
    try:
        if not pub.wait_for_subscribers(1, 30.0):
            raise SuiteError("the ZMQ ingest measurement's subscriber never connected")
        payloads = [[StoreEvent("stored", (b * events_per_batch + i).to_bytes(32, "big"), "gpu")
                     for i in range(events_per_batch)] for b in range(batches)]
        t0 = time.perf_counter()
        for events in payloads:
            pub.publish(events)
        feed = sub.feeds["bench"]
        deadline = time.monotonic() + 300
        while feed.last_seq != batches - 1:
            if time.monotonic() > deadline:
                raise SuiteError(f"the subscriber applied {feed.last_seq} of {batches} batches in 300 s")
            time.sleep(0.001)
        elapsed = time.perf_counter() - t0
        return batches * events_per_batch / elapsed, feed.lost_batches
    finally:
        sub.close()
        pub.close()


def plot(results: Results, path: Path) -> None:
    """Per scenario: hit rate and TTFT (mean and p90) per router; and each router's request shares."""
    scenarios = list(dict.fromkeys(f.params["scenario"] for f in results.figures if f.name == "hit_rate"))
    fig, axes = grid(2 * len(scenarios), f"Routing the Mooncake conversation trace to {REPLICAS} simulated replicas",
                     ncols=2)
    for k, scenario in enumerate(scenarios):
        pols = [f.params["policy"] for f in results.figures if f.name == "hit_rate" and f.params["scenario"] == scenario]
        x = np.arange(len(pols))
        ax = axes[2 * k]
        mean = [results.value("ttft_mean", scenario=scenario, policy=p) for p in pols]
        p90 = [results.value("ttft_p90", scenario=scenario, policy=p) for p in pols]
        ax.bar(x - 0.2, mean, 0.4, label="TTFT mean")
        ax.bar(x + 0.2, p90, 0.4, label="TTFT p90")
        ax.set_ylabel("seconds")
        twin = ax.twinx()
        twin.plot(x, [100 * results.value("hit_rate", scenario=scenario, policy=p) for p in pols], "ko-", label="hit %")
        twin.set_ylabel("hit rate (% of prompt tokens)")
        twin.set_ylim(bottom=0)
        ax.set_xticks(x, [p.replace("_", "\n") for p in pols], fontsize=7)
        ax.set_title(f"{scenario}: TTFT and hit rate", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
        twin.legend(fontsize=7, loc="upper right")
        ax = axes[2 * k + 1]
        reps = list(dict.fromkeys(f.params["replica"] for f in results.figures if f.name == "request_share"))
        for j, rep in enumerate(reps):
            ax.bar(x + (j - len(reps) / 2 + 0.5) * 0.8 / len(reps), [
                results.value("request_share", scenario=scenario, policy=p, replica=rep) for p in pols],
                0.8 / len(reps), label=rep)
        ax.axhline(1 / max(len(reps), 1), color="grey", lw=0.8)
        ax.set_xticks(x, [p.replace("_", "\n") for p in pols], fontsize=7)
        ax.set_ylabel("share of requests")
        ax.set_title(f"{scenario}: request share per replica", fontsize=10)
        ax.legend(fontsize=7)
    save(fig, path)
