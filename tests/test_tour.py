"""The README's five-minute tour runs as written, beside the daemon ``make run`` starts.

In a scratch copy of the checkout's configs and examples (relative paths, data and socket, resolve there as
from the repository root), the daemon starts as ``make run`` starts it; then each line of the tour's block
runs in a shell, ``.venv/bin/`` being this interpreter's environment. Each must exit 0 and print what the
README says it shows.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "daemon"))
from daemonlib import cleanup, short_tmpdir, start_daemon  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXPECT = {  # a word of each command, and what its output must contain
    "kvstore demo": "speedup",
    "examples/embed.py": "without kvstore: time to first token",
    "kvstore stats": "host",
    "kvstore generate": "Paris",
    "kvstore plan": "llama-3.1-70b",
}


def tour_lines() -> list[str]:
    """The commands of the README's tour block, comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text.split("## A five-minute tour", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "the README's tour has no bash block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_tour_runs_as_written_beside_make_runs_daemon() -> None:
    lines = tour_lines()
    assert len(lines) >= 5 and all(any(word in line for word in EXPECT) for line in lines), lines
    root = short_tmpdir()
    daemon = None
    try:
        shutil.copytree(REPO / "configs", root / "configs")
        shutil.copytree(REPO / "examples", root / "examples")
        env = {**os.environ, "KVSTORE_METRICS__PORT": "0", "PYTHONPATH": str(REPO)}
        daemon = start_daemon(root / "configs" / "default.yaml", cwd=root, env={"KVSTORE_METRICS__PORT": "0"})
        venv = str(Path(sys.executable).parent) + "/"
        for line in lines:
            res = subprocess.run(line.replace(".venv/bin/", venv), shell=True, cwd=root, env=env,
                                 capture_output=True, text=True, timeout=600)
            assert res.returncode == 0, f"{line}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
            want = next(text for word, text in EXPECT.items() if word in line)
            assert want in res.stdout, f"{line}: no {want!r} in\n{res.stdout[-2000:]}"
            if "KVSTORE_CONNECTOR=sidecar" in line:  # through the daemon, a new process: blocks from the daemon
                assert "again: cached prompt tokens: {'gpu': 0, 'host': 0, 'daemon:host': 1264, 'daemon:disk': 0}" in res.stdout, res.stdout
        assert daemon.stop() == 0
    finally:
        cleanup(daemon, root)
