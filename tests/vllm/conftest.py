"""tests/vllm: vLLM's real scheduler and connector code with kvstore, in .venv-vllm (``make venv-vllm``).

The main test run (kvstore's .venv, without vLLM) does not collect this
directory (tests/conftest.py); ``make test`` runs it in .venv-vllm.
"""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local config.json; never download
pytest.importorskip("vllm.config", reason="vLLM is not installed in this environment; `make venv-vllm` installs it")
sys.path.insert(0, str(Path(__file__).parent))
