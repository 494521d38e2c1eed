"""The README: its embedding example runs as written; every guarantee (docs/guarantees.md) names a test that exists."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "daemon"))
from daemonlib import cleanup, short_tmpdir, start_daemon  # noqa: E402

EXAMPLE_OUTPUT = re.compile(r"cached prompt tokens: (\{.*?\}) of (\d+);")


def readme_example(repo: Path) -> str:
    """The README's one Python example, exactly as written."""
    blocks = re.findall(r"```python\n(.*?)```", (repo / "README.md").read_text(), flags=re.S)
    assert len(blocks) == 1, "expected one Python example in the README"
    return blocks[0]


def run_example(code: str, cwd: Path, **env: str) -> tuple[str, list[dict[str, int]], int]:
    """Run ``code`` in a fresh interpreter in ``cwd``; returns (answer, cached prompt tokens by tier of its
    first and its second request, prompt tokens)."""
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env})
    assert res.returncode == 0, res.stderr
    answer = res.stdout.split("without kvstore:")[0]
    matches = EXAMPLE_OUTPUT.findall(res.stdout)
    assert len(matches) == 2 and "without kvstore: time to first token" in res.stdout, res.stdout
    cached = [ast.literal_eval(m[0]) for m in matches]
    prompt_tokens = int(matches[0][1])
    assert all(0 <= sum(c.values()) <= prompt_tokens for c in cached)
    return answer.strip(), cached, prompt_tokens


def test_example_file_is_the_readme_example(repo: Path) -> None:
    """``examples/embed.py`` is the README's example, character for character (one text, two places to read it)."""
    assert (repo / "examples" / "embed.py").read_text() == readme_example(repo)


def test_readme_example_through_the_daemon_of_make_run(repo: Path) -> None:
    """In a fresh checkout: ``make run`` (``kvstore serve --config configs/default.yaml``), then the README's
    example with ``KVSTORE_CONNECTOR=sidecar``, twice, on the default model, editing no file. The first run
    answers; the second, a new process with an empty GPU pool, gets its prompt's full blocks from the daemon and
    answers the same."""
    code = readme_example(repo)
    root = short_tmpdir()  # the checkout: relative paths (data, socket) resolve here, as from the repository root
    daemon = None
    try:
        shutil.copytree(repo / "configs", root / "configs")
        # metrics.port 0: the fixed default port may be taken on a shared test machine; nothing else is changed
        daemon = start_daemon(root / "configs" / "default.yaml", cwd=root, env={"KVSTORE_METRICS__PORT": "0"})
        first, cached_first, prompt_tokens = run_example(code, root, KVSTORE_CONNECTOR="sidecar")
        second, cached_second, _ = run_example(code, root, KVSTORE_CONNECTOR="sidecar")
        assert "Paris" in first  # a real answer from SmolLM2
        full = prompt_tokens // 16 * 16
        assert sum(cached_first[0].values()) == 0  # computed
        assert cached_first[1]["gpu"] == 0 and sum(cached_first[1].values()) == full  # out of the GPU, from the daemon
        assert cached_second[0]["gpu"] == 0 and cached_second[0]["host"] == 0  # a new process: not its own
        assert sum(cached_second[0].values()) == full > 0  # every full block, from the daemon
        assert second == first
        assert sorted(p.name for p in (root / ".kvstore-data").iterdir()) == ["kvstore.sock", "kvstore.sock.lock", "lmdb"]  # daemon only
        assert daemon.stop() == 0
    finally:
        cleanup(daemon, root)


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
    """A guarantee (docs/guarantees.md, linked from the README) names the test that proves it: each file and test
    function it names exists."""
    refs = _guarantee_refs((repo / "docs" / "guarantees.md").read_text())
    assert len(refs) >= 40, f"the Guarantees section names too few tests ({len(refs)})"
    missing = []
    for path, name in refs:
        file = repo / "tests" / path
        if not file.is_file():
            missing.append(path)
        elif name is not None and not re.search(rf"def {re.escape(name)}\(", file.read_text()):
            missing.append(f"{path}::{name}")
    assert not missing, f"the README names tests that do not exist: {missing}"
