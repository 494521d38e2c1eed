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


def _guarantee_refs(text: str) -> list[tuple[str, str | None]]:
    """Every ``path.py`` or ``path.py::test_name`` (and a following ``::test_more`` / ``, `_suffix```) that the
    Guarantees section's tables name, as (path under tests/, test name or None)."""
    section = text.split("## Guarantees", 1)[1].split("\n## ", 1)[0]
    refs: list[tuple[str, str | None]] = []
    for row in (line for line in section.splitlines() if line.startswith("| ") and ".py" in line):
        cell = row.rstrip(" |").rsplit("|", 1)[1]
        path = None
        for token in re.findall(r"`([^`]+)`", cell):
            name = token
            if ".py" in token:
                path, _, name = token.partition("::")
                refs.append((path, None))
            if path is None or not name:
                continue
            if name.startswith("test_") or name.startswith("::test_"):
                refs.append((path, name.lstrip(":")))
    return refs


def test_every_guarantee_names_a_test_that_exists(repo: Path) -> None:
    """A guarantee in the README names the test that proves it: each file and test function it names exists."""
    refs = _guarantee_refs((repo / "README.md").read_text())
    assert len(refs) >= 40, f"the Guarantees section names too few tests ({len(refs)})"
    missing = []
    for path, name in refs:
        file = repo / "tests" / path
        if not file.is_file():
            missing.append(path)
        elif name is not None and not re.search(rf"def {re.escape(name)}\(", file.read_text()):
            missing.append(f"{path}::{name}")
    assert not missing, f"the README names tests that do not exist: {missing}"
