"""Adapters that let vLLM (0.33.0) keep its KV cache in kvstore. Importing them needs vLLM (``make venv-vllm``).

- :mod:`connectors.vllm.tiering` and :mod:`connectors.vllm.offloading`: vLLM's
  OffloadingConnector with the tiering spec, kvstore as a secondary tier
  below vLLM's CPU tier.
- :mod:`connectors.vllm.connector`: a full ``KVConnectorBase_V1`` over kvstore.

This package module itself imports nothing from vLLM, so kvstore's own
environment can import ``connectors`` without it.
"""
