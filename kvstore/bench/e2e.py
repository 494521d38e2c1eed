"""Suite ``e2e``: the engine on multi-round chat, TTFT and throughput per caching mode, as ratios.

Modes, all on the same engine, model and requests:

- ``recompute``: the engine's plain :class:`~engine.block_manager.BlockManager`
  (every prompt is prefilled from scratch);
- ``gpu_prefix``: a connector-backed block manager with the GPU prefix cache
  only;
- ``tiered``: the same with the host and disk tiers below.

The workload: ``sessions`` chats share a system prompt; every round sends
each session's whole history plus a new user turn (all sessions of a round
are submitted together, so batching is realistic), generating a few tokens
per turn. TTFT = first token time - arrival time of each request. A
separate probe measures the TTFT of a 4k-token prefix plus 64 new tokens:
the first time (``cached_in=none``: all computed, the recompute reference
for the probe's ratios, in the same engine), then with new 64-token
suffixes while the prefix is on the GPU, and in ``tiered`` mode after
the connector's ``offload`` moved it to host RAM only, then to disk only (page
cache dropped when running as root). The issue's target case is host vs
recompute.

The model is the built-in Llama-style model with random weights (what runs
on any machine); the numbers measure the engine and the cache, not a
model's quality. Caching goes through the real connector
(``EmbeddedConnector`` + ``engine.connector_manager.ConnectorBlockManager``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.bench.harness import Progress, Results, SuiteOptions, scratch_dir
from kvstore.bench.plots import grid, grouped_bars, save
from kvstore.bench.rawio import drop_page_cache

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.sequence import SequenceMetrics
    from kvstore.config.schema import KVStoreConfig

PROBE_PREFIX = 4096
PROBE_NEW = 64
TARGET_TTFT_SPEEDUP = 5.0


def _arch(quick: bool) -> Any:
    from engine.config import ModelArch

    base = ModelArch.tiny(num_layers=2 if quick else 4, hidden_size=64 if quick else 256,
                            intermediate_size=128 if quick else 512, num_heads=4, num_kv_heads=2,
                            head_dim=16 if quick else 64)
    return dataclasses.replace(base, max_position_embeddings=8192)


def _modes(scratch: Path) -> dict[str, KVStoreConfig | None]:
    """The kvstore config per mode (``None`` = the engine's plain manager, no caching)."""
    from kvstore.config.schema import DiskConfig, HostConfig, KVStoreConfig

    return {
        "recompute": None,
        "gpu_prefix": KVStoreConfig(tiers=[]),
        "tiered": KVStoreConfig(tiers=["host", "lmdb"], host=HostConfig(capacity=1 << 30),
                                disk=DiskConfig(path=str(scratch / "lmdb"), max_size=2 << 30)),
    }


def _chat_rounds(rng: np.random.Generator, sessions: int, rounds: int, system: int, vocab: int) -> list[list[list[int]]]:
    """Prompts per round per session; each history grows by the user turn and a stand-in answer."""
    sys_prompt = rng.integers(0, vocab, size=system).tolist()
    history = [list(sys_prompt) for _ in range(sessions)]
    out = []
    for _ in range(rounds):
        batch = []
        for s in range(sessions):
            history[s] += rng.integers(0, vocab, size=int(rng.integers(48, 160))).tolist()
            batch.append(list(history[s]))
            history[s] += rng.integers(0, vocab, size=64).tolist()
        out.append(batch)
    return out


def _run_mode(kv_config: KVStoreConfig | None, quick: bool, rounds: list[list[list[int]]],
              probe: tuple[list[int], list[list[int]]], max_tokens: int, seed: int) -> dict[str, Any]:
    """One mode's chat rounds and prefix probes (``kv_config`` ``None``: no connector)."""
    from connectors.embedded import EmbeddedConnector
    from engine.engine_config import EngineConfig
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    cfg = EngineConfig(block_size=16, num_gpu_blocks=2048 if quick else 4096, max_num_batched_tokens=2048,
                       dtype="float32", seed=seed)
    connector = EmbeddedConnector(kv_config) if kv_config is not None else None
    llm = LLM(config=cfg, arch=_arch(quick), connector=connector)
    try:
        return _measure(llm, kv_config, rounds, probe, max_tokens)
    finally:
        if connector is not None:
            connector.close()


def _measure(llm: LLM, kv_config: KVStoreConfig | None, rounds: list[list[list[int]]],
             probe: tuple[list[int], list[list[int]]], max_tokens: int) -> dict[str, Any]:
    """Run the rounds, then probe the 4k prefix computed, from the GPU and (tiered) from host and disk."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    _probe(llm, list(range(1, 40)))  # untimed: first-call costs of torch and the engine
    ttfts: list[float] = []
    generated = 0
    t0 = time.perf_counter()
    for batch in rounds:
        seqs = [llm.add_request(p, params) for p in batch]
        while llm.has_unfinished():
            llm.step()
        ttfts += [_ttft(s.metrics) for s in seqs]
        generated += sum(len(s.output_token_ids) for s in seqs)
    wall = time.perf_counter() - t0
    prefix, suffixes = probe
    # Each probe is the 4k prefix plus PROBE_NEW new tokens never seen before, so the new part is computed.
    probe_ttft = {"none": _probe(llm, prefix + suffixes[0])}  # first sight of the prefix: computed in every mode
    connector = llm.connector
    if connector is not None and kv_config is not None:
        probe_ttft["gpu"] = _probe(llm, prefix + suffixes[1])
        if "host" in kv_config.tiers:
            connector.offload("gpu")  # the prefix now lives in host RAM only
            probe_ttft["host"] = _probe(llm, prefix + suffixes[2])
            connector.offload("gpu")
            connector.offload("host")  # ... and now on disk only
            drop_page_cache()  # cold disk when allowed (root); otherwise the page cache may still hold it
            probe_ttft["disk"] = _probe(llm, prefix + suffixes[3])
    prompt_tokens = sum(len(p) for b in rounds for p in b)
    return {"ttft": np.array(ttfts), "wall": wall, "generated": generated, "prompt_tokens": prompt_tokens,
            "probe_ttft": probe_ttft}


def _probe(llm: LLM, prompt: list[int]) -> float:
    """TTFT in seconds of one request for ``prompt`` run alone."""
    from engine.sampling_params import SamplingParams

    seq = llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while llm.has_unfinished():
        llm.step()
    return _ttft(seq.metrics)


def _ttft(metrics: SequenceMetrics) -> float:
    """Seconds from a finished request's arrival to its first token."""
    if metrics.first_token_time is None:
        raise RuntimeError("a finished benchmark request has no first-token time")
    return metrics.first_token_time - metrics.arrival_time


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Run the chat workload and the 4k probe in every available mode."""
    sessions, nrounds, system, max_tokens = (2, 2, 256, 2) if options.quick else (6, 4, 1024, 8)
    probe_len = 512 if options.quick else PROBE_PREFIX
    results = Results("e2e", options, {"sessions": sessions, "rounds": nrounds, "system_prompt_tokens": system,
                                       "max_tokens": max_tokens, "probe_prefix_tokens": probe_len, "probe_new_tokens": PROBE_NEW,
                                       "model": "built-in Llama-style, random weights", "dtype": "float32"})
    rng = np.random.default_rng(options.seed)
    vocab = _arch(options.quick).vocab_size
    rounds = _chat_rounds(rng, sessions, nrounds, system, vocab)
    probe = (rng.integers(0, vocab, size=probe_len).tolist(),
             [rng.integers(0, vocab, size=PROBE_NEW).tolist() for _ in range(4)])
    measured: dict[str, dict[str, Any]] = {}
    with scratch_dir(options) as scratch:
        modes = _modes(scratch)
        progress.grow(len(modes))
        for mode, kv_config in modes.items():
            measured[mode] = _run_mode(kv_config, options.quick, rounds, probe, max_tokens, options.seed)
            progress.step(mode)
    for mode, m in measured.items():
        results.add("ttft.p50", float(np.percentile(m["ttft"], 50)) * 1e3, "ms", mode=mode)
        results.add("ttft.p99", float(np.percentile(m["ttft"], 99)) * 1e3, "ms", mode=mode)
        results.add("throughput.output", m["generated"] / m["wall"], "tokens/s", mode=mode)
        results.add("throughput.prompt", m["prompt_tokens"] / m["wall"], "tokens/s", mode=mode)
        for source, t in m["probe_ttft"].items():
            results.add("ttft.probe", t * 1e3, "ms", mode=mode, cached_in=source, prefix_tokens=probe_len)
    base = measured["recompute"]
    for mode in measured.keys() - {"recompute"}:
        m = measured[mode]
        results.ratio("ttft.p50 speedup vs recompute", np.percentile(base["ttft"], 50), np.percentile(m["ttft"], 50),
                      mode=mode)
        results.ratio("throughput vs recompute", m["generated"] / m["wall"], base["generated"] / base["wall"],
                      mode=mode)
        for source, t in m["probe_ttft"].items():
            if source != "none":
                results.ratio("ttft.probe speedup vs recompute", m["probe_ttft"]["none"], t,
                              TARGET_TTFT_SPEEDUP if source == "host" else None, mode=mode, cached_in=source,
                              prefix_tokens=probe_len)
    return results


def plot(results: Results, path: Path) -> None:
    """Chat TTFT per mode, prefix-probe TTFT by where the prefix was cached, output throughput per mode."""
    modes = list(dict.fromkeys(f.params["mode"] for f in results.figures))
    fig, (ax_t, ax_p, ax_r) = grid(3, "Engine on multi-round chat: caching modes side by side")
    grouped_bars(ax_t, modes, {n: [results.value(n, mode=m) for m in modes] for n in ("ttft.p50", "ttft.p99")},
                 "ms", "time to first token, chat")
    probes = [f for f in results.figures if f.name == "ttft.probe"]
    grouped_bars(ax_p, [f"{f.params['mode']}/{f.params['cached_in']}" for f in probes],
                 {"TTFT": [f.value for f in probes]}, "ms", "prefix probe: mode / where the prefix was")
    ax_p.set_yscale("log")
    grouped_bars(ax_r, modes, {"output tokens/s": [results.value("throughput.output", mode=m) for m in modes]},
                 "tokens/s", "throughput, chat")
    save(fig, path)
