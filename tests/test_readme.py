"""The README's embedding example runs as written (in a scratch directory with the repo's configs)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path


def test_readme_python_example_runs(repo: Path, tmp_path: Path) -> None:
    text = (repo / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "expected one Python example in the README"
    shutil.copytree(repo / "configs", tmp_path / "configs")
    res = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert "'gpu'" in res.stdout and "'disk'" in res.stdout  # it printed the per-tier metrics
