"""`kvstore --help`, `config check`, `plan` and `stats` answer without importing torch or numpy;
`--help` does not import pydantic (or asyncio) either: it only lists the commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Runs the CLI in-process in a fresh interpreter, then reports its exit code and which heavy modules got imported.
_PROBE = """
import sys
from kvstore.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("TORCH_IMPORTED" if "torch" in sys.modules else "TORCH_NOT_IMPORTED", code)
print("HEAVY", sorted(m for m in ("torch", "numpy", "pydantic", "asyncio", "tqdm") if m in sys.modules))
"""


def _probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, cwd=REPO, timeout=60)


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("config", "check", "configs/default.yaml"),
        ("plan", "--model", "llama-3.1-70b", "--gpu-mem", "40GiB", "--host-mem", "512GiB",
         "--disk-size", "4TiB", "--host-bw", "25", "--disk-bw", "6"),
        ("plan", "--model", "llama-3.1-8b"),  # measures memcpy and direct reads itself: still no torch
    ],
    ids=["help", "config-check", "plan", "plan-measuring"],
)
def test_light_commands_do_not_import_torch(args: tuple[str, ...]) -> None:
    res = _probe(*args)
    assert res.stdout.splitlines()[-2] == "TORCH_NOT_IMPORTED 0", res.stdout + res.stderr
    heavy = res.stdout.splitlines()[-1]
    assert heavy == ("HEAVY []" if args == ("--help",) else "HEAVY ['pydantic']"), res.stdout + res.stderr


def test_stats_without_a_daemon_fails_cleanly_without_torch(tmp_path: Path) -> None:
    socket_path = tmp_path / "absent.sock"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"daemon:\n  socket_path: {socket_path}\n")
    res = _probe("stats", "--config", str(cfg))
    assert res.stdout.splitlines()[-2:] == ["TORCH_NOT_IMPORTED 1", "HEAVY ['pydantic']"], res.stdout + res.stderr
    assert res.stderr.startswith("error: ") and str(socket_path) in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
