"""Runs one real vLLM engine (``vllm.LLM``) through a list of rounds and writes what it did as JSON.

It runs in vLLM's own environment (``.venv-vllm-cpu`` or ``.venv-vllm``),
one engine per process, because a vLLM engine cannot be started twice in one
process and each start costs 20-60 s on a small CPU: the real-engine tests
(``tests/vllm_engine``) and ``python -m benchmarks vllm`` describe a whole engine
life as one job, run it with :func:`run_job` in a child process, and read
back every output, vLLM's own cache counters per round and timings::

    python -m benchmarks.vllm_driver JOB.json OUT.json
    python -m benchmarks.vllm_driver --serve JOB.json     # rounds as JSON lines on stdin, records on stdout

``--serve`` keeps the engine up and runs one round per line of stdin, answering
each with one line on stdout (after a ``{"ready": ...}`` line once the
engine is up), so a benchmark can interleave requests to several engines
that are all started.

A job (JSON): ``model`` (a local checkpoint directory), ``engine`` (keyword
arguments for ``vllm.LLM``: ``dtype``, ``block_size``, ``kv_transfer_config``,
``kv_cache_dtype``, ``num_gpu_blocks_override``...), and ``rounds``, each with
``prompts`` (lists of token ids), ``max_tokens``, optional ``cache_salts``,
``concurrent`` (all prompts in one ``generate`` call, else one call per
prompt, timed each) and ``before`` (``"reset_prefix_cache"`` or
``"reset_connector"``, done before the round; its result is recorded).

Per round the output has each prompt's ``token_ids``, ``text``,
``num_cached_tokens`` and ``seconds`` (one ``generate`` call's wall time:
the time to first token when ``max_tokens`` is 1), and the round's deltas of
vLLM's counters: ``prefix_cache_hits`` (tokens from vLLM's own cache),
``external_prefix_cache_hits`` (tokens vLLM loaded through the KV connector),
``external_prefix_cache_queries`` and ``num_preemptions``; with kvstore's connector also
``load_probe_s``, ``load_read_s`` and ``load_write_s`` (seconds its loads spent asking kvstore, copying
out of kvstore's tiers, copying into vLLM's KV cache: ``vllm:kvstore_load_step_seconds``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

#: vLLM counters read after each round (``vllm.LLM.get_metrics``), by the name used in the output.
COUNTERS = {
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "external_prefix_cache_hits": "vllm:external_prefix_cache_hits",
    "external_prefix_cache_queries": "vllm:external_prefix_cache_queries",
    "num_preemptions": "vllm:num_preemptions",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
}

#: kvstore's connector's seconds per load step (a counter labelled ``step``), read as ``load_<step>_s``.
STEP_COUNTER = "vllm:kvstore_load_step_seconds"
STEPS = ("probe", "read", "write")

#: Environment a CPU vLLM needs (see the README's vLLM section): KV cache space in GiB (without it vLLM
#: asks for most of the node's memory), and no OpenMP thread binding, so an engine with a KV connector
#: (vLLM then reserves a core for itself) runs the same threads as one without and computes the same floats.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0", "HF_HUB_OFFLINE": "1"}


def _counters(llm: Any) -> dict[str, float]:
    values: dict[str, float] = {}
    wanted = {v: k for k, v in COUNTERS.items()}
    for metric in llm.get_metrics():
        name = wanted.get(metric.name)
        if name is not None and hasattr(metric, "value"):
            values[name] = values.get(name, 0.0) + float(metric.value)
    values.update(_step_seconds())
    return values


def _step_seconds() -> dict[str, float]:
    """``load_<step>_s`` from kvstore's step counter, read from the Prometheus registry of this process (where
    vLLM's stat logger keeps it): ``LLM.get_metrics`` rounds counters down to whole numbers, and these are
    fractions of a second."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.name != STEP_COUNTER:
            continue
        for sample in family.samples:
            step = sample.labels.get("step")
            if sample.name == STEP_COUNTER + "_total" and step in STEPS:
                out[f"load_{step}_s"] = out.get(f"load_{step}_s", 0.0) + float(sample.value)
    return out


def _start(job: dict[str, Any]) -> Any:
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    engine = dict(job.get("engine", {}))
    engine.setdefault("enforce_eager", True)
    engine.setdefault("seed", 0)
    engine.setdefault("disable_log_stats", False)  # the counters come from vLLM's stats
    return LLM(job["model"], **engine)


def run_round(llm: Any, rnd: dict[str, Any]) -> dict[str, Any]:
    """One round (see the module docstring) on a started engine; its record."""
    from vllm import SamplingParams

    out: dict[str, Any] = {}
    before = rnd.get("before")
    if before == "reset_prefix_cache":
        out["before_result"] = llm.reset_prefix_cache()
    elif before == "reset_connector":
        out["before_result"] = llm.reset_prefix_cache(reset_connector=True)
    elif before is not None:
        raise ValueError(f"round 'before': {before!r} is not reset_prefix_cache or reset_connector")
    params = SamplingParams(max_tokens=int(rnd.get("max_tokens", 8)), temperature=0.0, ignore_eos=True)
    salts = rnd.get("cache_salts") or [None] * len(rnd["prompts"])
    # vLLM's TokensPrompt as the plain dict it is (its TypedDict's optional keys differ between 0.32 and 0.33)
    prompts: list[dict[str, Any]] = [{"prompt_token_ids": list(p), **({"cache_salt": s} if s else {})}
                                     for p, s in zip(rnd["prompts"], salts)]
    start = _counters(llm)
    results = []
    if rnd.get("concurrent"):
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        results = [(o, wall) for o in outputs]
    else:
        for p in prompts:
            t = time.perf_counter()
            (o,) = llm.generate([p], params, use_tqdm=False)
            results.append((o, time.perf_counter() - t))
    end = _counters(llm)
    out["outputs"] = [{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                       "num_cached_tokens": o.num_cached_tokens, "seconds": s} for o, s in results]
    out.update({k: end.get(k, 0.0) - start.get(k, 0.0) for k in [*COUNTERS, *(f"load_{s}_s" for s in STEPS)]})
    return out


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Start the engine the job describes, run its rounds, shut it down; returns the record (module docstring)."""
    t0 = time.perf_counter()
    llm = _start(job)
    record: dict[str, Any] = {"start_s": time.perf_counter() - t0,
                              "rounds": [run_round(llm, rnd) for rnd in job["rounds"]]}
    del llm
    return record


def serve(job: dict[str, Any]) -> int:
    """``--serve``: start the engine, then one round per stdin line, one record per stdout line."""
    t0 = time.perf_counter()
    llm = _start(job)
    reply = sys.stdout
    reply.write(json.dumps({"ready": True, "start_s": time.perf_counter() - t0}) + "\n")
    reply.flush()
    for line in sys.stdin:
        if line.strip():
            reply.write(json.dumps(run_round(llm, json.loads(line))) + "\n")
            reply.flush()
    return 0


def main(argv: list[str]) -> int:
    """``vllm_driver JOB.json OUT.json``: run the job, write its record; ``--serve JOB.json``: serve rounds."""
    if len(argv) == 2 and argv[0] == "--serve":
        return serve(json.loads(Path(argv[1]).read_text()))
    if len(argv) != 2:
        sys.stderr.write("usage: python -m benchmarks.vllm_driver JOB.json OUT.json | --serve JOB.json\n")
        return 2
    job = json.loads(Path(argv[0]).read_text())
    record = run_job(job)
    Path(argv[1]).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
