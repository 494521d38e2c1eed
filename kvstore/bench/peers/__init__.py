"""The ``peers`` suite: kvstore beside the real peers' code, each in its own environment and process.

:mod:`kvstore.bench.peers.suite` runs the rounds; :mod:`.process` drives a
peer script (:mod:`.vllm_lookup` here, :mod:`kvstore.bench.peers_sglang_radix`
for SGLang) over its JSON-lines protocol.
"""
