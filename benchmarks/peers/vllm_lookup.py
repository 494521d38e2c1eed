"""vLLM's real prefix lookup timed on the ``peers`` suite's prompts: run under ``.venv-vllm``'s python.

Self-contained on purpose: it imports vLLM (0.33.0, ``make venv-vllm``) and
nothing of kvstore. It builds the same prompts as :mod:`kvstore.bench.lookup`
and :mod:`benchmarks.peers.suite` (numpy's ``default_rng(seed).integers(0,
128_000)``; a sibling sharing the first half), fills a ``BlockPool`` the way
``cache_full_blocks`` leaves it (one ``KVCacheBlock`` per block hash in
``cached_block_hash_to_block``) and times, per prompt length:

- ``vllm.lookup``: what the scheduler does for a new request: vLLM's
  ``hash_block_tokens`` with its ``sha256`` (pickle) for every full block,
  then ``FullAttentionManager.find_longest_cache_hit``;
- ``vllm.hash``: the hash chain alone.

Protocol (the same as :mod:`benchmarks.peers.sglang_radix`): one JSON line
``{"ready": ...}``, then one round per line read on stdin, each printed as
``{"round": i, "figures": [{"name", "prompt_tokens", "ms"}...]}`` (best of
``--repeat``); exits at end of input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any


def _best_ms(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    """Parse the options, import vLLM, and answer rounds (see the module docstring)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,16384,32768,65536,131072", help="prompt lengths, comma-separated")
    ap.add_argument("--block-size", type=int, default=16, help="vLLM block size (kvstore's block size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=7, help="timings per figure per round (the best is kept)")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    bs = args.block_size

    t0 = time.perf_counter()
    import numpy as np
    import torch
    import vllm
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import (KVCacheBlock, hash_block_tokens, init_none_hash,
                                             make_block_hash_with_group_id)
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import_s = time.perf_counter() - t0
    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype=torch.float16)

    def block_hashes(tokens: list[int]) -> list[Any]:
        parent = None
        out = []
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = hash_block_tokens(sha256, parent, tokens[start : start + bs])
            out.append(parent)
        return out

    rng = np.random.default_rng(args.seed)
    cases: list[dict[str, Any]] = []
    for n in lengths:  # the same draws, in the same order, as kvstore.bench.lookup
        tokens = rng.integers(0, 128_000, size=n, dtype=np.int64).tolist()
        sibling = tokens[: n // 2] + rng.integers(0, 128_000, size=n - n // 2).tolist()
        pool = BlockPool(num_gpu_blocks=2 * (n // bs) + 1, enable_caching=True, hash_block_size=bs)
        block_id = 1
        for t in (sibling, tokens):
            for h in block_hashes(t):
                key = make_block_hash_with_group_id(h, 0)
                if pool.cached_block_hash_to_block.get_one_block(key) is None:
                    pool.cached_block_hash_to_block.insert(key, KVCacheBlock(block_id))
                    block_id += 1

        def lookup(tokens: list[int] = tokens, pool: BlockPool = pool, n: int = n) -> int:
            hit, _ = FullAttentionManager.find_longest_cache_hit(block_hashes(tokens), n, [0], pool, spec, False, bs)
            return len(hit[0])

        if lookup() != n // bs:
            raise SystemExit(f"vllm_lookup: vLLM matched {lookup()} of {n // bs} blocks")
        cases.append({"n": n, "tokens": tokens, "lookup": lookup})

    def one_round(i: int) -> dict[str, Any]:
        figures = []
        for c in cases:
            figures.append({"name": "vllm.lookup", "prompt_tokens": c["n"], "ms": _best_ms(c["lookup"], args.repeat)})
            figures.append({"name": "vllm.hash", "prompt_tokens": c["n"],
                            "ms": _best_ms(lambda: block_hashes(c["tokens"]), args.repeat)})
        return {"round": i, "figures": figures}

    print(json.dumps({"ready": True, "vllm": vllm.__version__, "python": sys.version.split()[0],
                      "import_s": round(import_s, 2), "block_size": bs, "lengths": lengths}), flush=True)
    for i, _line in enumerate(sys.stdin):
        print(json.dumps(one_round(i)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
