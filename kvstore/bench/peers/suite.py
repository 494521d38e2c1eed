"""Suite ``peers``: kvstore's lookup and commit beside real vLLM and real SGLang, interleaved, paired per round.

Each peer runs in its own environment and process (``make venv-vllm``,
``make venv-sglang``; ``KVSTORE_VLLM_PYTHON`` / ``KVSTORE_SGLANG_PYTHON`` name
another interpreter) through :class:`~kvstore.bench.peers.process.PeerProcess`.
Every round times kvstore here, then each peer, on the same prompts (the
same seeded draws as :mod:`kvstore.bench.lookup`); figures are medians over
rounds and every ratio is the median of the per-round ratios.

Rows: ``kvstore.lookup`` (``TieredStore.lookup``), ``kvstore.key_path``
(``block_keys`` + ``match_keys``), ``kvstore.commit`` (``TieredStore.commit``
into a fresh store); ``vllm.lookup`` (``hash_block_tokens`` + sha256 +
``find_longest_cache_hit``), ``vllm.hash``; ``sglang.match_prefix`` (incl.
``RadixKey`` build), ``sglang.insert``. A peer that cannot run is skipped
with the reason in ``results.json``. LMCache and the disk / host rows of
issue 15's table are not measured by this suite yet (``skipped`` says so).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.harness import Progress, Results, SuiteOptions, timeit
from kvstore.bench.lookup import BLOCK_SIZE, SGLANG_SCRIPT, fresh_store, time_commit
from kvstore.bench.peers.process import PeerProcess
from kvstore.bench.plots import grid, save
from kvstore.hashing import block_keys
from kvstore.layout import KVLayout

FULL_TOKENS = (4096, 32768, 131072)
QUICK_TOKENS = (1024, 4096)
ROOT = Path(__file__).resolve().parents[3]
VLLM_SCRIPT = Path(__file__).with_name("vllm_lookup.py")
PEERS: dict[str, tuple[str, Path, str]] = {
    "vllm": ("KVSTORE_VLLM_PYTHON", VLLM_SCRIPT, ".venv-vllm"),
    "sglang": ("KVSTORE_SGLANG_PYTHON", SGLANG_SCRIPT, ".venv-sglang"),
}
"""Peer name -> (environment variable naming its python, its script, its venv in the checkout)."""
PAIRS: tuple[tuple[str, str, str, float | None], ...] = (
    ("speedup.kvstore_lookup/vllm_lookup", "vllm.lookup", "kvstore.lookup", None),
    ("speedup.kvstore_key_path/vllm_lookup", "vllm.lookup", "kvstore.key_path", 5.0),
    ("speedup.kvstore_lookup/sglang_match_prefix", "sglang.match_prefix", "kvstore.lookup", 1.0),
    ("speedup.kvstore_commit/sglang_insert", "sglang.insert", "kvstore.commit", 1.0),
)
"""(ratio name, peer figure, kvstore figure, target at the longest prompt): ratio = peer ms / kvstore ms."""
NOT_MEASURED = {
    "lmcache": "LMCache 0.5.6 (local disk / local CPU backends, token database) is not driven by this suite yet; "
               "make venv-lmcache builds its environment",
    "disk_and_host_rows": "durable put / cold get / host put-get against LMCache and the machine's limits: not in this "
                          "suite yet (kvstore bench tiers measures kvstore against memcpy and raw direct I/O)",
}


def _python(peer: str) -> str | None:
    env, _script, venv = PEERS[peer]
    override = os.environ.get(env)
    if override:
        return override
    path = ROOT / venv / "bin" / "python"
    return str(path) if path.exists() else None


def _start_peers(options: SuiteOptions, results: Results, lengths: tuple[int, ...], repeat: int) -> dict[str, PeerProcess]:
    peers: dict[str, PeerProcess] = {}
    for name, (env, script, venv) in PEERS.items():
        python = _python(name)
        if options.quick:
            results.skip(name, "--quick: the peer's import alone takes a minute here; run without --quick")
        elif python is None:
            results.skip(name, f"no environment at {ROOT / venv} (make {venv.lstrip('.')}, or {env}=/path/to/python)")
        else:
            try:
                peers[name] = PeerProcess(python, script, ["--lengths", ",".join(map(str, lengths)), "--seed",
                                                           str(options.seed), "--block-size", str(BLOCK_SIZE),
                                                           "--repeat", str(repeat)])
                results.config[name] = {k: peers[name].info.get(k) for k in (name, "python", "import_s")}
            except (OSError, RuntimeError, ValueError) as exc:
                results.skip(name, f"{python} could not run {script.name}: {exc}")
    return peers


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Rounds of kvstore then every peer, on the same prompts; medians and per-round paired ratios."""
    lengths = QUICK_TOKENS if options.quick else FULL_TOKENS
    repeat = 3 if options.quick else 5
    rounds = 2 if options.quick else 5
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=BLOCK_SIZE, model_id="bench-peers")
    results = Results("peers", options, {"prompt_tokens": list(lengths), "block_size": BLOCK_SIZE, "repeat": repeat,
                                         "rounds": rounds, "timing": "best of repeat per round; median over rounds; "
                                         "ratios paired per round", "load_1min": os.getloadavg()[0]})
    for what, why in NOT_MEASURED.items():
        results.skip(what, why)
    rng = np.random.default_rng(options.seed)
    cases: list[dict[str, Any]] = []
    for n in lengths:  # the peers' scripts draw the same prompts in the same order
        tokens = rng.integers(0, 128_000, size=n, dtype=np.int64).tolist()
        sibling = tokens[: n // 2] + rng.integers(0, 128_000, size=n - n // 2).tolist()
        store = fresh_store(layout, 2 * (n // BLOCK_SIZE) + 1)
        for t in (sibling, tokens):
            keys = block_keys(t, layout)
            ids = store.allocate(len(keys))
            store.commit(keys, ids, tokens=t)
            store.free(ids)
        assert store.lookup(tokens).num_blocks == n // BLOCK_SIZE
        cases.append({"n": n, "tokens": tokens, "store": store, "keys": keys})

    peers = _start_peers(options, results, lengths, repeat)
    samples: dict[tuple[str, int], list[float]] = {}
    progress.grow(rounds)
    try:
        for r in range(rounds):
            for c in cases:
                n, store, tokens, keys = c["n"], c["store"], c["tokens"], c["keys"]
                timed: tuple[tuple[str, Callable[[], object]], ...] = (
                    ("kvstore.lookup", lambda: store.lookup(tokens)),
                    ("kvstore.key_path", lambda: store.index.match_keys(block_keys(tokens, layout))),
                )
                for name, fn in timed:
                    samples.setdefault((name, n), []).append(timeit(fn, repeat) * 1e3)
                samples.setdefault(("kvstore.commit", n), []).append(time_commit(layout, keys, tokens, repeat) * 1e3)
            for peer in peers.values():
                for key, ms in peer.round().items():
                    samples.setdefault(key, []).append(ms)
            progress.step(f"round {r + 1}/{rounds}")
    finally:
        for peer in peers.values():
            peer.close()
    _report(results, samples, lengths)
    return results


def _report(results: Results, samples: dict[tuple[str, int], list[float]], lengths: tuple[int, ...]) -> None:
    for (name, n), ms in samples.items():
        results.add(name, statistics.median(ms), "ms", prompt_tokens=n, blocks=n // BLOCK_SIZE,
                    rounds=[round(x, 4) for x in ms])
    for n in lengths:
        for label, peer, ours, target in PAIRS:
            a, b = samples.get((peer, n)), samples.get((ours, n))
            if a and b:
                per_round = [x / y for x, y in zip(a, b)]
                results.ratio(label, statistics.median(per_round), 1.0, target if n == max(FULL_TOKENS) else None,
                              prompt_tokens=n, rounds=[round(x, 3) for x in per_round])


def plot(results: Results, path: Path) -> None:
    """Time per prompt length of every row (log-log), and the paired speedups."""
    fig, (ax_t, ax_s) = grid(2, f"kvstore vs real peers, {BLOCK_SIZE}-token blocks, prompt cached")
    for name in sorted({f.name for f in results.figures}):
        pts = sorted((f.params["prompt_tokens"], f.value) for f in results.figures if f.name == name)
        ax_t.plot([x for x, _ in pts], [y for _, y in pts], "o-" if name.startswith("kvstore") else "s--", label=name)
    ax_t.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="ms")
    ax_t.legend(fontsize=7)
    ax_t.grid(alpha=0.3)
    for label, _peer, _ours, target in PAIRS:
        pts = sorted((r.params["prompt_tokens"], r.value) for r in results.ratios if r.name == label)
        if pts:
            ax_s.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=label.removeprefix("speedup."))
    ax_s.axhline(1.0, color="red", lw=0.8, ls="--", label="parity")
    ax_s.set(xscale="log", xlabel="prompt tokens", ylabel="peer time / kvstore time (x)")
    ax_s.legend(fontsize=7)
    ax_s.grid(alpha=0.3)
    save(fig, path)
