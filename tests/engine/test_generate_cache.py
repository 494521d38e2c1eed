"""``kvstore generate --config``: the prompts' KV goes through the connector the config names, and a second run
finds the first run's blocks (here in the embedded store's own default directory)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

PROMPT = "A prompt long enough for three full blocks of sixteen b"  # 55 bytes + BOS: 56 tokens


def _generate(cwd: Path) -> list[str]:
    res = subprocess.run([sys.executable, "-m", "kvstore", "generate", "--model", "builtin", "--config",
                          "configs/default.yaml", "--max-tokens", "2", PROMPT],
                         capture_output=True, text=True, cwd=cwd, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


def test_generate_with_a_config_caches_through_its_connector(repo: Path, tmp_path: Path) -> None:
    shutil.copytree(repo / "configs", tmp_path / "configs")
    first, second = _generate(tmp_path), _generate(tmp_path)
    assert first[0] == second[0] == f"[1] {PROMPT}"
    assert first[2] == "(cached prompt tokens: {'gpu': 0, 'host': 0, 'disk': 0} of 56)"
    assert second[2] == "(cached prompt tokens: {'gpu': 0, 'host': 0, 'disk': 48} of 56)"  # 3 blocks of 16
    assert first[1] == second[1]  # the same answer from cached KV
    assert (tmp_path / ".kvstore-data" / "embedded" / "lmdb" / "data.mdb").is_file()
