"""Suite ``lookup``: kvstore's hash chain + radix match beside a vLLM-style SHA-256 baseline.

For prompts of 1k to 128k tokens, with the prompt already cached (the
longest walk), each side is timed from token ids to "how many leading
blocks are cached":

- kvstore (what a lookup does): :meth:`RadixIndex.match`, a walk of the
  radix tree by token comparison, no hashing (keys are computed only for
  the part of a prompt beyond the in-memory match, to probe lower tiers);
- kvstore, key path: :func:`~kvstore.hashing.block_keys` (BLAKE2b chain over
  the tokens' uint32 bytes) + :meth:`RadixIndex.match_keys`: what it costs
  when the whole prompt must be hashed (nothing in memory, lower tiers probed);
- baseline: :mod:`kvstore.bench.vllm_hash_baseline` (SHA-256 over a pickled
  tuple per block) + one dict probe per block, as vLLM does for every request.

All receive the prompt as a Python ``list[int]`` (what an engine holds);
kvstore is also timed on a numpy array.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvstore.bench.harness import Progress, Results, SuiteOptions, timeit
from kvstore.bench.plots import grid, save
from kvstore.bench.vllm_hash_baseline import VLLMPrefixCache
from kvstore.layout import KVLayout
from kvstore.radix import RadixIndex

FULL_TOKENS = (1024, 4096, 16384, 32768, 65536, 131072)
QUICK_TOKENS = (1024, 4096)
BLOCK_SIZE = 16
TARGET_SPEEDUP = 5.0


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Time both lookups at every prompt length; a shared half-length branch makes the tree realistic."""
    lengths = QUICK_TOKENS if options.quick else FULL_TOKENS
    repeat = 3 if options.quick else 7
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=BLOCK_SIZE, model_id="bench-lookup")
    results = Results("lookup", options, {"prompt_tokens": list(lengths), "block_size": BLOCK_SIZE,
                                          "repeat": repeat, "timing": "best of repeat, wall clock",
                                          "kvstore_hash": "BLAKE2b-256 chain", "baseline_hash": "SHA-256(pickle)"})
    rng = np.random.default_rng(options.seed)
    progress.grow(len(lengths))
    for n in lengths:
        arr = rng.integers(0, 128_000, size=n, dtype=np.int64)
        tokens = arr.tolist()
        sibling = tokens[: n // 2] + rng.integers(0, 128_000, size=n - n // 2).tolist()
        index = RadixIndex(layout)
        for t in (sibling, tokens):
            keys = index.keys_for(t)
            index.insert(keys, gpu_blocks=list(range(len(index), len(index) + len(keys))), tokens=t)
        base = VLLMPrefixCache(BLOCK_SIZE)
        base.insert(sibling)
        base.insert(tokens)
        blocks = n // BLOCK_SIZE
        assert index.match(tokens).num_blocks == blocks and base.match(tokens) == blocks
        assert index.match_keys(index.keys_for(tokens)).num_blocks == blocks
        t_list = timeit(lambda: index.match(tokens), repeat)
        t_arr = timeit(lambda: index.match(arr), repeat)  # type: ignore[arg-type]  # measured on purpose: match takes any int sequence, numpy too
        t_keys = timeit(lambda: index.match_keys(index.keys_for(tokens)), repeat)
        t_hash = timeit(lambda: index.keys_for(tokens), repeat)
        t_base = timeit(lambda: base.match(tokens), repeat)
        p = {"prompt_tokens": n, "blocks": blocks}
        results.add("kvstore.lookup", t_list * 1e3, "ms", input="list", **p)
        results.add("kvstore.lookup", t_arr * 1e3, "ms", input="numpy", **p)
        results.add("kvstore.key_path", t_keys * 1e3, "ms", input="list", **p)
        results.add("kvstore.hash_only", t_hash * 1e3, "ms", input="list", **p)
        results.add("baseline.lookup", t_base * 1e3, "ms", input="list", **p)
        results.add("kvstore.lookup_rate", n / t_list / 1e6, "Mtokens/s", input="list", **p)
        results.add("baseline.lookup_rate", n / t_base / 1e6, "Mtokens/s", input="list", **p)
        results.ratio("speedup.kvstore/baseline", t_base, t_list,
                      TARGET_SPEEDUP if n == max(FULL_TOKENS) else None, input="list", **p)
        results.ratio("speedup.kvstore/baseline", t_base, t_arr, None, input="numpy", **p)
        results.ratio("speedup.kvstore_key_path/baseline", t_base, t_keys, None, input="list", **p)
        progress.step(f"{n} tokens")
    return results


def plot(results: Results, path: Path) -> None:
    """Lookup time against prompt length (log-log), and the speedup."""
    fig, (ax_t, ax_s) = grid(2, f"Prefix lookup (hash chain + match), {BLOCK_SIZE}-token blocks, prompt cached")
    for name, label, style in (("kvstore.lookup", "kvstore radix walk by tokens", "o-"),
                               ("kvstore.key_path", "kvstore BLAKE2b chain + key match", "d-."),
                               ("baseline.lookup", "vLLM-style SHA-256(pickle) + dict", "s--")):
        pts = [(f.params["prompt_tokens"], f.value) for f in results.figures
               if f.name == name and f.params.get("input") == "list"]
        ax_t.plot([x for x, _ in pts], [y for _, y in pts], style, label=label)
    ax_t.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="ms per lookup")
    ax_t.legend(fontsize=7)
    ax_t.grid(alpha=0.3)
    for rname, inp, style, label in (("speedup.kvstore/baseline", "list", "o-", "token walk, list input"),
                                     ("speedup.kvstore/baseline", "numpy", "^:", "token walk, numpy input"),
                                     ("speedup.kvstore_key_path/baseline", "list", "d-.", "key path (hash all)")):
        pts = [(r.params["prompt_tokens"], r.value) for r in results.ratios
               if r.name == rname and r.params.get("input") == inp]
        ax_s.plot([x for x, _ in pts], [y for _, y in pts], style, label=label)
    ax_s.axhline(TARGET_SPEEDUP, color="red", lw=0.8, ls="--", label=f"target {TARGET_SPEEDUP:g}x")
    ax_s.set(xscale="log", xlabel="prompt tokens", ylabel="speedup over baseline (x)")
    ax_s.legend(fontsize=7)
    ax_s.grid(alpha=0.3)
    save(fig, path)
