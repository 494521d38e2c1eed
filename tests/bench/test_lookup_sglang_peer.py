"""The lookup suite's SGLang peer protocol: one JSON line when ready, one per round asked, exit at end of input."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvstore.bench.lookup import sglang_peer

FAKE = '''
import json, sys
print(json.dumps({"ready": True, "sglang": "fake", "args": sys.argv[1:]}), flush=True)
for i, _ in enumerate(sys.stdin):
    print(json.dumps({"round": i, "figures": [{"name": "sglang.match_prefix", "prompt_tokens": 1024, "ms": 0.5 + i}]}),
          flush=True)
'''


def test_peer_answers_rounds_in_order_with_the_suites_prompt_options(fake_python: Callable[[str], str]) -> None:
    peer = sglang_peer(fake_python(FAKE), (1024, 4096), seed=3, repeat=5)
    try:
        assert peer.info["args"][3:] == ["--lengths", "1024,4096", "--seed", "3", "--block-size", "16", "--repeat", "5"]
        assert peer.info["args"][:2] == ["-W", "ignore"]
        assert peer.info["args"][2].endswith("kvstore/bench/peers_sglang_radix.py")
        assert peer.round() == {("sglang.match_prefix", 1024): 0.5}
        assert peer.round() == {("sglang.match_prefix", 1024): 1.5}
    finally:
        peer.close()
    assert peer.proc.returncode == 0


def test_a_peer_that_dies_is_an_error_carrying_its_stderr(fake_python: Callable[[str], str]) -> None:
    with pytest.raises(RuntimeError, match=r"peers_sglang_radix.py exited \(3\): no SGLang here"):
        sglang_peer(fake_python("import sys\nsys.stderr.write('no SGLang here')\nsys.exit(3)\n"),
                   (1024,), seed=0, repeat=1)
