"""Prefill and decode throughput of the built-in engine on this machine (measured, never asserted).

Prefill: a batch of prompts, each generating one token, timed from submission
to the last first-token; tokens/s counts prompt tokens. Decode: a batch of
short prompts; once every sequence has its first token, the remaining steps
are timed and tokens/s counts the generated tokens. A warm-up pass runs first
(Triton compiles its kernels then). Results go to stdout and, with ``--out``,
to a JSON file.

    python benchmarks/engine_bench.py --out bench-out/engine_cpu.json
    python benchmarks/engine_bench.py --preset gpu --device cuda --out bench-out/engine_gpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from engine import LLM, EngineConfig, ModelConfig, SamplingParams

PRESETS: dict[str, dict[str, int]] = {
    # A model small enough for two CPU cores.
    "cpu": dict(layers=4, hidden=256, heads=8, kv_heads=2, intermediate=512, batch=8, prompt_len=128,
                decode_tokens=32, budget=1024),
    # Roughly a 1B-parameter Llama shape, for a GPU.
    "gpu": dict(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, batch=64, prompt_len=512,
                decode_tokens=128, budget=8192),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


def measure_prefill(llm: LLM, batch: int, prompt_len: int) -> dict[str, float]:
    """Prompt tokens per second for ``batch`` prompts of ``prompt_len`` tokens."""
    prompts = _prompts(batch, prompt_len, llm.model_config.vocab_size, seed=1)
    _sync(llm.pool.device)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    _sync(llm.pool.device)
    elapsed = time.perf_counter() - start
    return {"tokens": batch * prompt_len, "seconds": elapsed, "tokens_per_s": batch * prompt_len / elapsed}


def measure_decode(llm: LLM, batch: int, prompt_len: int, decode_tokens: int) -> dict[str, float]:
    """Generated tokens per second after prefill, for ``batch`` concurrent sequences."""
    prompts = _prompts(batch, prompt_len, llm.model_config.vocab_size, seed=2)
    params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
    seqs = [llm.add_request(p, params) for p in prompts]
    while any(not s.output_token_ids for s in seqs):
        llm.step()
    _sync(llm.pool.device)
    start = time.perf_counter()
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    _sync(llm.pool.device)
    elapsed = time.perf_counter() - start
    tokens = batch * (decode_tokens - 1)
    return {"tokens": tokens, "steps": steps, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "ms_per_step": 1000 * elapsed / max(steps, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="model and batch sizes (default: cpu); the flags below override single values")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="local checkpoint directory instead of a random model of the preset's shape")
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "batch", "prompt_len", "decode_tokens",
                 "budget"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"override the preset's {name.replace('_', ' ')}"
                            + (" (per-step token budget)" if name == "budget" else ""))
    parser.add_argument("--backend", choices=["auto", "triton", "torch"], default="auto",
                        help="attention kernels (default: auto = Triton on CUDA, torch on the CPU)")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                        help="weights and KV dtype (default: auto = bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--device", default=None, help="torch device (default: CUDA if available, else CPU)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON to this file")
    args = parser.parse_args(argv)

    sizes = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in PRESETS[args.preset].items()}
    model_config = None if args.model else ModelConfig.tiny(
        num_layers=sizes["layers"], hidden_size=sizes["hidden"], num_heads=sizes["heads"],
        num_kv_heads=sizes["kv_heads"], head_dim=sizes["hidden"] // sizes["heads"],
        intermediate_size=sizes["intermediate"], vocab_size=32000)
    per_seq_blocks = -(-(sizes["prompt_len"] + sizes["decode_tokens"]) // args.block_size)
    config = EngineConfig(block_size=args.block_size, num_gpu_blocks=per_seq_blocks * sizes["batch"] + 8,
                          max_num_batched_tokens=sizes["budget"], max_num_seqs=sizes["batch"],
                          backend=args.backend, dtype=args.dtype, device=args.device)
    llm = LLM(args.model, config=config, model_config=model_config)
    torch.set_grad_enabled(False)

    measure_prefill(llm, min(2, sizes["batch"]), min(32, sizes["prompt_len"]))  # warm-up / compile
    measure_decode(llm, min(2, sizes["batch"]), 8, 4)
    prefill = measure_prefill(llm, sizes["batch"], sizes["prompt_len"])
    decode = measure_decode(llm, sizes["batch"], sizes["prompt_len"], sizes["decode_tokens"])

    result = {
        "benchmark": "engine_throughput",
        "device": str(llm.pool.device),
        "device_name": torch.cuda.get_device_name(llm.pool.device) if llm.pool.device.type == "cuda"
        else platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "backend": llm.runner.backend.name,
        "dtype": llm.pool.layout.dtype,
        "model": args.model or "random",
        "sizes": sizes,
        "block_size": args.block_size,
        "prefill": prefill,
        "decode": decode,
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
