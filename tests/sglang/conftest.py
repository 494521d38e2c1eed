"""SGLang test bootstrap: the torchvision/tvm_ffi import stubs go in before anything imports SGLang.

These tests run in ``.venv-sglang`` (``make venv-sglang``; ``make test`` runs
them after the main suite). The project's own run does not collect this folder
(``collect_ignore`` in ``tests/conftest.py``), since its environment has no
SGLang; each test module calls :func:`sglang_stubs.require_sglang` first, so
an interpreter without SGLang skips them with the reason.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))  # daemonlib: a real `kvstore serve` subprocess

import sglang_stubs  # noqa: E402

sglang_stubs.install()
