"""kvstore's own benchmark suites: kvstore beside a baseline and beside the machine's own limit, in one run.

Each suite is a module with ``run(options, progress) -> Results``; it measures
kvstore and its reference points side by side and reports ratios. The
harness (:mod:`kvstore.bench.harness`) writes ``results.json`` and the
suite's PNG plot. Suites are registered here by name so the CLI
(``kvstore bench SUITE``) finds them without importing every suite (the
``tiers`` and ``e2e`` suites pull in heavier dependencies).

These suites need nothing but kvstore's own install, so they ship with it:
an operator measures a machine with ``kvstore bench`` from a wheel. The suites
that drive other projects' environments and servers (real vLLM, SGLang,
LMCache, Redis) are harnesses of the checkout, in ``benchmarks/``, run with
``python -m benchmarks SUITE``; they reuse this package's harness.
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
    "route": "kvstore.bench.route",
}
"""Suite name -> module implementing ``run(options, progress)``."""

SUITE_HELP: dict[str, str] = {
    "tiers": "host / LMDB / file tier bandwidth against memcpy and raw direct I/O; block sizes; codecs",
    "lookup": "TieredStore.lookup / commit and the hash chain against a vLLM-style baseline, 1k-128k tokens",
    "evict": "GPU victim selection time with 1k / 10k / 100k host-only radix nodes (must stay flat)",
    "hitrate": "replayed workloads: each named placement policy against pooled caches, GPU-only LRU and Belady",
    "e2e": "TTFT on SmolLM2 with a long shared prefix: recompute vs cached in the GPU pool, host RAM, LMDB",
    "plan": "capacity plan of model presets from the bandwidths measured in the same run",
    "soak": "reliability: daemon + client processes under kill -9; lost/wrong blocks, memory growth, holds",
    "route": "Mooncake trace on N simulated replicas: round robin vs SGLang approx tree vs kvstore events + cost",
}
"""One line per suite for ``--help``."""

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "mooncake_conversation_trace.jsonl.gz"
"""The Mooncake conversation trace kept in the checkout (``benchmarks/data/README.md`` says where it comes
from); the ``hitrate`` and ``route`` suites replay it unless ``--trace`` names another file. A wheel does not
carry it (a data set is no part of the product): from a wheel, pass ``--trace``."""
