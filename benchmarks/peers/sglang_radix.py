"""SGLang's real radix cache timed on the ``lookup`` suite's prompts: run under ``.venv-sglang``'s python.

Self-contained on purpose: it imports SGLang (0.5.23, ``make venv-sglang``) and
nothing of kvstore but the import stubs SGLang's package needs on a CPU-only
machine (``tests/sglang/sglang_stubs.py``, loaded by path). It builds the same
prompts as :mod:`kvstore.bench.lookup` (the same seed: numpy's
``default_rng(seed).integers(0, 128_000)``; a sibling sharing the first half)
and times, per prompt length:

- ``match_prefix``: ``RadixCache.match_prefix`` of the cached prompt, including
  its key build (``RadixKey(array("q", tokens))`` from a Python list, what the
  scheduler does per request);
- ``insert``: the key build plus ``RadixCache.insert`` of the whole prompt into
  a fresh tree (the KV index tensor is made beforehand: the engine has it; the
  previous repeat's tree is collected before the new one is made, as on
  kvstore's side).

Protocol, so that a parent can interleave it with its own measurements without
paying SGLang's import (seconds) per round: the script prints one JSON line
``{"ready": ...}``, then for every line it reads on stdin it runs one round
(every length, each timing the best of ``--repeat``) and prints one JSON line
``{"round": i, "figures": [{"name", "prompt_tokens", "ms"}...]}``; it exits at
end of input. ``--rounds N`` instead runs N rounds without reading stdin.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

STUBS = Path(__file__).resolve().parents[2] / "tests" / "sglang" / "sglang_stubs.py"


def _install_stubs() -> None:
    """Answer SGLang's torchvision / tvm_ffi imports with placeholders (see the stubs module for why)."""
    if not STUBS.is_file():
        raise SystemExit(f"peers_sglang_radix: {STUBS} is missing (run from a kvstore checkout)")
    spec = importlib.util.spec_from_file_location("sglang_stubs", STUBS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.install()


def _best_ms(fn: Callable[[], object], repeat: int, setup: Callable[[], None] | None = None) -> float:
    best = float("inf")
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    """Parse the options, import SGLang, and answer rounds (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,16384,32768,65536,131072", help="prompt lengths, comma-separated")
    ap.add_argument("--block-size", type=int, default=16, help="SGLang page size (kvstore's block size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=7, help="timings per figure per round (the best is kept)")
    ap.add_argument("--rounds", type=int, default=0, help="run this many rounds without reading stdin")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]

    t0 = time.perf_counter()
    _install_stubs()
    import numpy as np
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    import sglang

    import_s = time.perf_counter() - t0

    rng = np.random.default_rng(args.seed)
    cases: list[dict[str, Any]] = []
    for n in lengths:  # the same draws, in the same order, as kvstore.bench.lookup
        tokens = rng.integers(0, 128_000, size=n, dtype=np.int64).tolist()
        sibling = tokens[: n // 2] + rng.integers(0, 128_000, size=n - n // 2).tolist()
        cache = RadixCache.create_simulated(page_size=args.block_size)
        for i, t in enumerate((sibling, tokens)):
            cache.insert(InsertParams(key=RadixKey(array("q", t)),
                                      value=torch.arange(i * n, (i + 1) * n, dtype=torch.int64)))
        blocks = n // args.block_size
        got = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).device_prefix_len
        if got != blocks * args.block_size:
            raise SystemExit(f"peers_sglang_radix: SGLang matched {got} of {n} tokens")
        cases.append({"n": n, "tokens": tokens, "cache": cache, "value": torch.arange(n, dtype=torch.int64)})

    def one_round(i: int) -> dict[str, Any]:
        figures = []
        for c in cases:
            tokens, cache, value = c["tokens"], c["cache"], c["value"]
            t_match = _best_ms(lambda: cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))),
                               args.repeat)
            fresh: list[Any] = []

            def new_tree() -> None:
                fresh.clear()
                gc.collect()  # the previous repeat's tree is garbage: collected before, as kvstore's side does
                fresh.append(RadixCache.create_simulated(page_size=args.block_size))

            t_insert = _best_ms(lambda: fresh[0].insert(InsertParams(key=RadixKey(array("q", tokens)), value=value)),
                                args.repeat, setup=new_tree)
            figures.append({"name": "sglang.match_prefix", "prompt_tokens": c["n"], "ms": t_match})
            figures.append({"name": "sglang.insert", "prompt_tokens": c["n"], "ms": t_insert})
        return {"round": i, "figures": figures}

    print(json.dumps({"ready": True, "sglang": sglang.__version__, "python": sys.version.split()[0],
                      "import_s": round(import_s, 2), "block_size": args.block_size, "lengths": lengths}),
          flush=True)
    if args.rounds:
        for i in range(args.rounds):
            print(json.dumps(one_round(i)), flush=True)
        return 0
    for i, _line in enumerate(sys.stdin):
        print(json.dumps(one_round(i)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
