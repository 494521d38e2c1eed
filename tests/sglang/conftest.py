"""SGLang test bootstrap: import stubs first, then skip (with the reason) where SGLang is not installed.

These tests run in ``.venv-sglang`` (``make venv-sglang``; ``make test`` runs
them after the main suite). The project's own run ignores this folder
(``tests/conftest.py``), since its environment has no SGLang.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))  # daemonlib: a real `kvstore serve` subprocess

import sglang_stubs  # noqa: E402

sglang_stubs.install()

try:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401,E402
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"SGLang 0.5.23 cannot be imported here ({exc}); create its environment with `make venv-sglang` "
        "and run these tests with .venv-sglang/bin/python",
        allow_module_level=True,
    )
