"""tests/vllm: vLLM's real scheduler and connector code with kvstore, in .venv-vllm (``make venv-vllm``).

The main test run (kvstore's .venv, without vLLM) does not collect this
directory (tests/conftest.py); ``make test`` runs it in .venv-vllm.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local config.json; never download
sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_offload_region_left_behind():
    """Remove the ``/dev/shm/vllm_offload_*`` files a test's offloading workers created.

    vLLM's shared offload region unlinks its file once every worker has mapped
    it, through a barrier the harness's single in-process worker does not
    have; without this, each offloading test left three 1 MiB files in /dev/shm.
    """
    shm = Path("/dev/shm")
    before = set(shm.glob("vllm_offload_*"))
    yield
    for path in set(shm.glob("vllm_offload_*")) - before:
        path.unlink(missing_ok=True)
