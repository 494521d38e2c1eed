"""Suite ``peers``: kvstore beside real vLLM, SGLang and LMCache, interleaved, paired per round.

Each peer runs in its own environment and process (``make venv-vllm``,
``make venv-sglang``, ``make venv-lmcache``; ``KVSTORE_VLLM_PYTHON`` /
``KVSTORE_SGLANG_PYTHON`` / ``KVSTORE_LMCACHE_PYTHON`` name another
interpreter) through :class:`~benchmarks.peers.process.PeerProcess`.
Every round times kvstore here (and the machine's limits), then each peer,
on the same prompts (the same seeded draws as :mod:`kvstore.bench.lookup`)
and the same blocks; figures are medians over rounds and every ratio is the
median of the per-round ratios.

Rows: ``kvstore.lookup`` (``TieredStore.lookup``), ``kvstore.key_path``
(``block_keys`` + ``match_keys``), ``kvstore.commit`` (``TieredStore.commit``
into a fresh store); ``vllm.lookup`` (``hash_block_tokens`` + sha256 +
``find_longest_cache_hit``), ``vllm.hash``; ``sglang.match_prefix`` (incl.
``RadixKey`` build), ``sglang.insert``; ``lmcache.lookup``
(``ChunkedTokenDatabase`` + ``LocalCPUBackend.contains``); and the disk / host
rows of :mod:`.storage` (LMDB and host tier against LMCache's
``LocalDiskBackend`` / ``LocalCPUBackend``, raw direct I/O and memcpy). A
peer that cannot run is skipped with the reason in ``results.json``.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.harness import Progress, Results, SuiteOptions, scratch_dir, timeit
from kvstore.bench.lookup import BLOCK_SIZE, fresh_store, time_commit
from benchmarks.peers import storage
from benchmarks.peers.process import PeerProcess
from kvstore.bench.plots import grid, save
from kvstore.hashing import block_keys
from kvstore.layout import KVLayout

FULL_TOKENS = (4096, 32768, 131072)
QUICK_TOKENS = (1024, 4096)
ROOT = Path(__file__).resolve().parents[2]
VLLM_SCRIPT = Path(__file__).with_name("vllm_lookup.py")
LMCACHE_SCRIPT = Path(__file__).with_name("lmcache_storage.py")
SGLANG_SCRIPT = Path(__file__).with_name("sglang_radix.py")
PEERS: dict[str, tuple[str, Path, str]] = {
    "vllm": ("KVSTORE_VLLM_PYTHON", VLLM_SCRIPT, ".venv-vllm"),
    "sglang": ("KVSTORE_SGLANG_PYTHON", SGLANG_SCRIPT, ".venv-sglang"),
    "lmcache": ("KVSTORE_LMCACHE_PYTHON", LMCACHE_SCRIPT, ".venv-lmcache"),
}
"""Peer name -> (environment variable naming its python, its script, its venv in the checkout)."""
PAIRS: tuple[tuple[str, str, str, float | None], ...] = (
    ("speedup.kvstore_lookup/vllm_lookup", "vllm.lookup", "kvstore.lookup", None),
    ("speedup.kvstore_key_path/vllm_lookup", "vllm.lookup", "kvstore.key_path", 5.0),
    ("speedup.kvstore_lookup/sglang_match_prefix", "sglang.match_prefix", "kvstore.lookup", 1.0),
    ("speedup.kvstore_commit/sglang_insert", "sglang.insert", "kvstore.commit", 1.0),
    ("speedup.kvstore_lookup/lmcache_lookup", "lmcache.lookup", "kvstore.lookup", None),
)
"""(ratio name, peer figure, kvstore figure, target at the longest prompt): ratio = peer ms / kvstore ms."""
NOT_MEASURED = {
    "lmcache_commit": "LMCache's index insert of a prompt (the commit row's LMCache index) is not timed by "
                      "this suite yet; its lookup and storage backends are",
}


def _python(peer: str) -> str | None:
    env, _script, venv = PEERS[peer]
    override = os.environ.get(env)
    if override:
        return override
    path = ROOT / venv / "bin" / "python"
    return str(path) if path.exists() else None


def _start_peers(options: SuiteOptions, results: Results, lengths: tuple[int, ...], repeat: int,
                 extra: dict[str, list[str]] | None = None) -> dict[str, PeerProcess]:
    """Every peer that can run, started with the prompts' options and its own ``extra`` ones; the others skipped."""
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
                                                           str(options.seed), "--repeat", str(repeat),
                                                           *(extra or {}).get(name, [])])
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

    with scratch_dir(options) as data:  # the blocks shared with the LMCache peer, and its files
        bench = storage.prepare(options, data)
        results.config["storage"] = {"disk_block_bytes": list(storage.DISK_SIZES), "total_bytes": bench.total,
                                     "host_block_bytes": list(storage.HOST_SIZES), "lmcache_durability":
                                     "os.sync() after its writes complete (LMCache never fsyncs)",
                                     "cold": "drop_caches before every cold get"}
        extra = {"vllm": ["--block-size", str(BLOCK_SIZE)], "sglang": ["--block-size", str(BLOCK_SIZE)],
                 "lmcache": bench.peer_args()}
        peers = _start_peers(options, results, lengths, repeat, extra)
        samples: dict[tuple[str, int], list[float]] = {}
        disk_host: storage.Samples = {}
        progress.grow(rounds)
        try:
            for r in range(rounds):
                _kvstore_round(cases, layout, repeat, samples)
                for key, gbps in storage.kvstore_round(bench, results, r).items():
                    disk_host.setdefault(key, []).append(gbps)
                for peer in peers.values():
                    for f in peer.round_figures():
                        if "gbps" in f:
                            disk_host.setdefault((f["name"], f["block_bytes"]), []).append(f["gbps"])
                        else:
                            samples.setdefault((f["name"], f["prompt_tokens"]), []).append(f["ms"])
                progress.step(f"round {r + 1}/{rounds}")
        finally:
            for peer in peers.values():
                peer.close()
    results.config["load_1min_end"] = os.getloadavg()[0]
    _report(results, samples, lengths)
    storage.report(results, disk_host, bench.total)
    return results


def _kvstore_round(cases: list[dict[str, Any]], layout: KVLayout, repeat: int,
                   samples: dict[tuple[str, int], list[float]]) -> None:
    """Append one round of kvstore's lookup, key path and commit times (ms) to ``samples``."""
    for c in cases:
        n, store, tokens, keys = c["n"], c["store"], c["tokens"], c["keys"]
        timed: tuple[tuple[str, Callable[[], object]], ...] = (
            ("kvstore.lookup", lambda: store.lookup(tokens)),
            ("kvstore.key_path", lambda: store.index.match_keys(block_keys(tokens, layout))),
        )
        for name, fn in timed:
            samples.setdefault((name, n), []).append(timeit(fn, repeat) * 1e3)
        samples.setdefault(("kvstore.commit", n), []).append(time_commit(layout, keys, tokens, repeat) * 1e3)


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
    """Time per prompt length of every lookup / commit row (log-log), the paired speedups, and the storage rows."""
    fig, (ax_t, ax_s, ax_d, ax_h) = grid(4, f"kvstore vs real peers, {BLOCK_SIZE}-token blocks, prompt cached",
                                         ncols=2)
    timed = [f for f in results.figures if "prompt_tokens" in f.params]
    for name in sorted({f.name for f in timed}):
        pts = sorted((f.params["prompt_tokens"], f.value) for f in timed if f.name == name)
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
    storage.plot(results, ax_d, ax_h)
    save(fig, path)
