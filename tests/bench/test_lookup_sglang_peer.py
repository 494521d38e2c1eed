"""The lookup suite's SGLang peer protocol: one JSON line when ready, one per round asked, exit at end of input."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvstore.bench.lookup import sglang_peer

FAKE = '''
import json, sys
print(json.dumps({"ready": True, "sglang": "fake", "args": sys.argv[1:]}), flush=True)
for i, _ in enumerate(sys.stdin):
    print(json.dumps({"round": i, "figures": [{"name": "sglang.match_prefix", "prompt_tokens": 1024, "ms": 0.5 + i}]}),
          flush=True)
'''


def _fake_python(tmp_path: Path, body: str) -> str:
    """An interpreter stand-in that runs ``body`` instead of the script it is given."""
    script = tmp_path / "fake.py"
    script.write_text(body)
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    exe.chmod(0o755)
    return str(exe)


def test_peer_answers_rounds_in_order_with_the_suites_prompt_options(tmp_path: Path) -> None:
    peer = sglang_peer(_fake_python(tmp_path, FAKE), (1024, 4096), seed=3, repeat=5)
    try:
        assert peer.info["args"][3:] == ["--lengths", "1024,4096", "--seed", "3", "--block-size", "16", "--repeat", "5"]
        assert peer.info["args"][:2] == ["-W", "ignore"]
        assert peer.info["args"][2].endswith("kvstore/bench/peers_sglang_radix.py")
        assert peer.round() == {("sglang.match_prefix", 1024): 0.5}
        assert peer.round() == {("sglang.match_prefix", 1024): 1.5}
    finally:
        peer.close()
    assert peer.proc.returncode == 0


def test_a_peer_that_dies_is_an_error_carrying_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"peers_sglang_radix.py exited \(3\): no SGLang here"):
        sglang_peer(_fake_python(tmp_path, "import sys\nsys.stderr.write('no SGLang here')\nsys.exit(3)\n"),
                   (1024,), seed=0, repeat=1)
