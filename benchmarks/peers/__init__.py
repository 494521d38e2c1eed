"""The ``peers`` suite: kvstore beside the real peers' code, each in its own environment and process.

:mod:`benchmarks.peers.suite` runs the rounds; :mod:`.process` drives a
peer script (:mod:`.vllm_lookup` here, :mod:`benchmarks.peers.sglang_radix`
for SGLang) over its JSON-lines protocol.
"""
