"""The checkout's ``route`` suite: kvstore's own (simulated replicas) or, with ``--replicas vllm``, two real vLLM
servers (:mod:`benchmarks.route_vllm`). One suite name for both, as one question: does routing by KV events pay."""

from __future__ import annotations

from pathlib import Path

from benchmarks import route_vllm
from kvstore.bench import route
from kvstore.bench.harness import Progress, Results, SuiteOptions


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Real vLLM replicas when ``options.replicas`` says so, else the trace replay on simulated ones."""
    return (route_vllm.run if options.replicas == "vllm" else route.run)(options, progress)


def plot(results: Results, path: Path) -> None:
    """The plot of whichever replicas the run used."""
    (route_vllm.plot if results.config.get("replicas") == "vllm" else route.plot)(results, path)
