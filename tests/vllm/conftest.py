"""tests/vllm: vLLM's real scheduler and connector code with kvstore, in .venv-vllm (``make venv-vllm``).

The main test run (kvstore's .venv, without vLLM) does not collect this
directory (tests/conftest.py); ``make test`` runs it in .venv-vllm.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local config.json; never download
sys.path.insert(0, str(Path(__file__).parent))
