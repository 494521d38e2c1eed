"""The one skip of tests/vllm: vLLM is not installed in the running environment (``make venv-vllm`` installs it)."""

import pytest


def require_vllm() -> None:
    """Skip the calling test module, saying why, unless vLLM's config module imports."""
    pytest.importorskip("vllm.config", reason="vLLM is not installed in this environment; `make venv-vllm` "
                                              "installs it into .venv-vllm and `make test` runs tests/vllm there")
