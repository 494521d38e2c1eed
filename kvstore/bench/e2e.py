"""Suite ``e2e``: time to first token of a real model with a long shared prefix, computed or cached in each tier.

The workload is document QA (:mod:`kvstore.bench.e2e_prompts`): every
request is the same long document (``prefix_tokens`` tokens, a whole number
of blocks) plus a short question. Two engines load the same model:

- ``recompute``: the engine's plain :class:`~engine.block_manager.BlockManager`,
  no cache at all: every prompt is prefilled from scratch;
- a cached engine: :class:`~engine.connector_manager.ConnectorBlockManager`
  over an :class:`~connectors.embedded.EmbeddedConnector` with
  ``tiers: [host, lmdb]``. Its first request computes and stores the
  prefix (``first_sight``); then each repeat asks its question with the
  prefix in the GPU block pool (``gpu``), after the connector's
  ``offload("gpu")`` (host RAM only: ``host``), and after
  ``offload("host")`` too (LMDB only, page cache dropped when running as
  root: ``disk``).

Each repeat runs its question in all four modes back to back, so each
cached TTFT is paired with a recompute TTFT taken moments before on the same
machine; the ratios are per repeat, and their median is the headline. Every
cached request must serve the whole prefix from the tier it names and give
output tokens equal to recompute's (:mod:`kvstore.bench.e2e_check`), else
the run fails.

The model is the engine's default, SmolLM2-135M-Instruct
(:mod:`engine.default_model`); ``--quick`` uses the built-in tiny model with
random weights (what runs anywhere in seconds), as does ``--model builtin``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.bench.e2e_check import CACHED_MODES, MODES, RunRecord, check_run
from kvstore.bench.e2e_prompts import DOCUMENT_SOURCE, DocQAPrompts, build_prompts
from kvstore.bench.harness import Progress, Results, SuiteError, SuiteOptions, scratch_dir
from kvstore.bench.plots import grid, save
from kvstore.bench.rawio import drop_page_cache

if TYPE_CHECKING:
    from engine.config import ModelArch
    from connectors.base import KVConnector
    from engine.llm import LLM
    from kvstore.config.schema import KVStoreConfig

TARGET_TTFT_SPEEDUP = 5.0
"""TTFT with the prefix in host RAM at least 5x faster than recomputing it: below that, offloading a prefix
is not worth its memory for the prompt lengths chat and document QA send."""
HOST_BYTES = 2 << 30
DISK_BYTES = 4 << 30


@dataclass(frozen=True)
class E2EPlan:
    """What one run does; a pure function of the options (:func:`plan`), so it is known before anything loads."""

    model: str
    """As ``kvstore generate --model`` takes it: ``default`` (SmolLM2), ``builtin`` or a path."""
    prefix_tokens: int
    repeats: int
    max_tokens: int
    """Output tokens per request, all compared with recompute's (EOS ignored, so always this many)."""
    block_size: int
    """Tokens per KV block: large enough that each question fits in the partial block after the prefix."""
    quick: bool


def plan(options: SuiteOptions) -> E2EPlan:
    """The run's model and sizes: SmolLM2 unless ``options.model`` or ``quick`` says otherwise.

    Defaults: real model 2,048-token prefix, 5 repeats, 16 output tokens
    (``quick``: 256, 2, 4); built-in model 4,096, 5, 8 (``quick``: 512, 2, 4).
    The built-in model's byte tokenizer makes a question about 60 tokens, so
    its blocks are 128 tokens; a real tokenizer's fit in 32.
    """
    model = options.model or ("builtin" if options.quick else "default")
    builtin = model == "builtin"
    prefix, repeats, max_tokens = ((512 if builtin else 256), 2, 4) if options.quick else \
        ((4096 if builtin else 2048), 5, (8 if builtin else 16))
    return E2EPlan(model=model, prefix_tokens=options.prefix_tokens or prefix, repeats=options.repeats or repeats,
                   max_tokens=max_tokens, block_size=128 if builtin else 32, quick=options.quick)


def _builtin_arch(quick: bool) -> ModelArch:
    from engine.config import ModelArch

    base = ModelArch.tiny(num_layers=2 if quick else 4, hidden_size=64 if quick else 256,
                          intermediate_size=128 if quick else 512, num_heads=4, num_kv_heads=2,
                          head_dim=16 if quick else 64)
    return dataclasses.replace(base, max_position_embeddings=8192)


def _tiered_config(scratch: Path) -> KVStoreConfig:
    """The cached engine's store: host RAM and LMDB under ``scratch``, both far larger than the run needs, written
    through (each tier keeps its copy, so moving the prefix down with ``offload`` leaves it in the tier measured;
    under ``write_back`` a flushed block the disk holds is freed from the GPU, not copied into host)."""
    from kvstore.config.schema import DiskConfig, HostConfig, KVStoreConfig, PolicyConfig

    return KVStoreConfig(tiers=["host", "lmdb"], host=HostConfig(capacity=HOST_BYTES),
                         disk=DiskConfig(path=str(scratch / "lmdb"), max_size=DISK_BYTES),
                         policy=PolicyConfig(write="write_through"))


def _engines(p: E2EPlan, scratch: Path) -> tuple[LLM, LLM]:
    """The recompute engine and the cached engine on the same model (loaded twice: they share nothing)."""
    from connectors.embedded import EmbeddedConnector
    from engine.config import CheckpointError
    from engine.default_model import resolve_model
    from engine.engine_config import EngineConfig
    from engine.llm import LLM

    config = EngineConfig(block_size=p.block_size, num_gpu_blocks=4 * (p.prefix_tokens // p.block_size) + 64,
                          max_num_batched_tokens=512, dtype="float32")
    try:
        model = resolve_model(p.model)
        arch = _builtin_arch(p.quick) if model is None else None
        recompute = LLM(model, config=config, arch=arch)
        cached = LLM(model, config=config, arch=arch, connector=EmbeddedConnector(_tiered_config(scratch)))
    except CheckpointError as exc:
        raise SuiteError(f"model {p.model!r}: {exc}") from None
    return recompute, cached


def _timed(llm: LLM, prompt: list[int], max_tokens: int) -> RunRecord:
    """Run one request alone to completion; its TTFT, output and where its prompt's tokens came from."""
    from engine.sampling_params import SamplingParams

    seq = llm.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while llm.has_unfinished():
        llm.step()
    m = seq.metrics
    if m.first_token_time is None:
        raise SuiteError("a finished request has no first-token time")
    return RunRecord(ttft_s=m.first_token_time - m.arrival_time, output_ids=tuple(seq.output_token_ids),
                     cached_by_tier=dict(m.cached_tokens_by_tier), computed_tokens=m.num_prefill_tokens_computed,
                     prompt_tokens=len(prompt))


def _connector(llm: LLM) -> KVConnector:
    if llm.connector is None:
        raise SuiteError("the cached engine has no connector")
    return llm.connector


def _move_prefix(llm: LLM, mode: str) -> bool:
    """Move the cached engine's blocks down to the tier ``mode`` names (``gpu``: leave them); for ``disk``,
    ``True`` when the page cache was dropped too."""
    connector = _connector(llm)
    if mode in ("host", "disk"):
        connector.offload("gpu")
    if mode == "disk":
        connector.offload("host")
        return drop_page_cache()
    return False


def _repeats(p: E2EPlan, recompute: LLM, cached: LLM, prompts: DocQAPrompts,
             progress: Progress) -> tuple[list[dict[str, RunRecord]], list[bool]]:
    """Every repeat's four modes, checked; and per repeat whether the disk run found the page cache dropped."""
    runs: list[dict[str, RunRecord]] = []
    dropped: list[bool] = []
    for r, suffix in enumerate(prompts.suffixes):
        prompt = prompts.prefix + suffix
        where = f"repeat {r + 1}"
        # Write-through copies go down in the background: let them finish before each timed request, so none
        # competes with it for the CPU (here, with recompute too).
        _connector(cached).flush()
        record = {"recompute": _timed(recompute, prompt, p.max_tokens)}
        check_run("recompute", where, record["recompute"], None, p.prefix_tokens)
        progress.step(f"repeat {r + 1}/{p.repeats} recompute")
        for mode in CACHED_MODES:
            _connector(cached).flush()
            moved = _move_prefix(cached, mode)
            if mode == "disk":
                dropped.append(moved)
            record[mode] = _timed(cached, prompt, p.max_tokens)
            check_run(mode, where, record[mode], record["recompute"], p.prefix_tokens)
            progress.step(f"repeat {r + 1}/{p.repeats} {mode}")
        runs.append(record)
    return runs, dropped


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Load the model twice, store the prefix once, then time every repeat in every mode."""
    p = plan(options)
    progress.grow(3 + len(MODES) * p.repeats)
    load_before = os.getloadavg()
    with scratch_dir(options) as scratch:
        t0 = time.perf_counter()
        recompute, cached = _engines(p, scratch)
        progress.step("models loaded")
        try:
            prompts = build_prompts(recompute.tokenizer, recompute.chat_template, p.prefix_tokens, p.block_size,
                                    p.repeats)
            for llm in (recompute, cached):  # untimed: torch's and the engine's first-call costs
                _timed(llm, prompts.warmup, 2)
            progress.step("warm-up")
            first = _timed(cached, prompts.prefix + prompts.first_sight, p.max_tokens)
            check_run("recompute", "first sight", first, None, p.prefix_tokens)  # nothing was cached yet
            progress.step("first sight: compute and store the prefix")
            runs, dropped = _repeats(p, recompute, cached, prompts, progress)
            wall = time.perf_counter() - t0
        finally:
            if cached.connector is not None:
                cached.connector.close()
    results = Results("e2e", options, _config(p, recompute, prompts, load_before, wall))
    _record(results, p, runs, first)
    eos = set(recompute.eos_token_ids)
    answer = list(runs[0]["recompute"].output_ids)
    answer = answer[:next((i for i, t in enumerate(answer) if t in eos), len(answer))]
    results.note(f"repeat 1 question {prompts.questions[0]!r}, answer (recompute, {p.max_tokens} tokens, cut at "
                 f"EOS): {recompute.tokenizer.decode(answer)!r}")
    results.note(f"output tokens of gpu, host and disk equal recompute's in all {p.repeats} repeats "
                 f"({p.max_tokens} tokens each); every cached request served its whole prefix from its tier")
    results.note("page cache dropped before every disk run" if all(dropped) else
                 "page cache could not be dropped (not root) before some disk runs: LMDB reads may be warm")
    return results


def _config(p: E2EPlan, llm: LLM, prompts: DocQAPrompts, load_before: tuple[float, float, float],
            wall: float) -> dict[str, Any]:
    a = llm.arch
    layout = llm.pool.layout
    return {**dataclasses.asdict(p),
            "model_description": ("SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)" if p.model == "default" else
                                  "built-in Llama-style, random weights" if p.model == "builtin" else p.model),
            "arch": {"layers": a.num_layers, "hidden": a.hidden_size, "heads": a.num_heads,
                     "kv_heads": a.num_kv_heads, "head_dim": a.head_dim, "vocab": a.vocab_size},
            "dtype": layout.dtype, "device": str(llm.pool.device), "workload": "document QA",
            "document": DOCUMENT_SOURCE, "questions": prompts.questions,
            "suffix_tokens": [len(s) for s in prompts.suffixes],
            "prefix_kv_bytes": layout.bytes_per_token * p.prefix_tokens,
            "tiers": {"host_bytes": HOST_BYTES, "lmdb_max_bytes": DISK_BYTES}, "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()), "wall_s": wall}


def _record(results: Results, p: E2EPlan, runs: list[dict[str, RunRecord]], first: RunRecord) -> None:
    """Per-repeat TTFTs and paired ratios, then medians."""
    results.add("ttft.first_sight", first.ttft_s * 1e3, "ms", prefix_tokens=p.prefix_tokens)
    for r, record in enumerate(runs):
        for mode in MODES:
            results.add("ttft", record[mode].ttft_s * 1e3, "ms", mode=mode, repeat=r)
        for mode in CACHED_MODES:
            results.ratio("ttft speedup vs recompute", record["recompute"].ttft_s, record[mode].ttft_s,
                          mode=mode, repeat=r)
    for mode in MODES:
        results.add("ttft.median", statistics.median(rec[mode].ttft_s for rec in runs) * 1e3, "ms", mode=mode,
                    prefix_tokens=p.prefix_tokens)
    for mode in CACHED_MODES:
        paired = statistics.median(rec["recompute"].ttft_s / rec[mode].ttft_s for rec in runs)
        results.ratio("ttft speedup vs recompute, median of repeats", paired, 1.0,
                      TARGET_TTFT_SPEEDUP if mode == "host" else None, mode=mode, prefix_tokens=p.prefix_tokens,
                      repeats=p.repeats)
    results.ratio("ttft first sight (cached engine, nothing cached yet) / recompute median", first.ttft_s,
                  statistics.median(rec["recompute"].ttft_s for rec in runs))


def plot(results: Results, path: Path) -> None:
    """TTFT per mode (median bar, one dot per repeat) and the paired speedups over recompute, both log scale."""
    fig, (ax_t, ax_r) = grid(2, f"TTFT, {results.config['prefix_tokens']}-token shared prefix: "
                                f"{results.config['model_description']}", ncols=2, size=(5.6, 3.8))
    for i, mode in enumerate(MODES):
        ax_t.bar(i, results.value("ttft.median", mode=mode), 0.6, color=f"C{i}", alpha=0.6)
        per_repeat = [f.value for f in results.figures if f.name == "ttft" and f.params["mode"] == mode]
        ax_t.scatter([i] * len(per_repeat), per_repeat, color="k", s=10, zorder=3)
    ax_t.set_xticks(range(len(MODES)), [f"{m}" if m == "recompute" else f"from {m}" for m in MODES])
    ax_t.set_yscale("log")
    ax_t.set_ylabel("ms")
    ax_t.set_title("time to first token (bar: median, dots: repeats)", fontsize=10)
    for i, mode in enumerate(CACHED_MODES):
        per_repeat = [r.value for r in results.ratios if r.name == "ttft speedup vs recompute"
                      and r.params["mode"] == mode]
        median = next(r.value for r in results.ratios if r.name.endswith("median of repeats")
                      and r.params["mode"] == mode)
        ax_r.bar(i, median, 0.6, color=f"C{i + 1}", alpha=0.6)
        ax_r.scatter([i] * len(per_repeat), per_repeat, color="k", s=10, zorder=3)
        ax_r.annotate(f"{median:.0f}x" if median >= 10 else f"{median:.1f}x", (i, median), ha="center",
                      va="bottom", fontsize=8)
    ax_r.axhline(TARGET_TTFT_SPEEDUP, color="grey", linestyle="--", linewidth=0.8, label="target (host) 5x")
    ax_r.set_xticks(range(len(CACHED_MODES)), [f"from {m}" for m in CACHED_MODES])
    ax_r.set_yscale("log")
    ax_r.set_ylabel("recompute TTFT / cached TTFT")
    ax_r.set_title("speedup over recompute, paired per repeat", fontsize=10)
    ax_r.legend(fontsize=7)
    for ax in (ax_t, ax_r):
        ax.grid(axis="y", alpha=0.3)
    save(fig, path)
