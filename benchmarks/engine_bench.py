"""Prefill and decode throughput of the built-in engine on this machine (measured, never asserted).

Prefill: a batch of prompts, each generating one token, timed from submission
to the last first-token; tokens/s counts prompt tokens. Decode: a batch of
short prompts; once every sequence has its first token, the remaining steps
are timed and tokens/s counts the generated tokens. A warm-up pass runs first
(Triton compiles its kernels then). Each phase is also put beside the
machine's limit measured in the same run: prefill FLOP/s against a dense
matmul of the same width, decode bytes/s (weights + KV read per step)
against a memcpy. Results go to stdout and, with ``--out``, to a JSON file
and a PNG plot next to it.

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

from engine import LLM, EngineConfig, ModelArch, SamplingParams

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
    prompts = _prompts(batch, prompt_len, llm.arch.vocab_size, seed=1)
    _sync(llm.pool.device)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    _sync(llm.pool.device)
    elapsed = time.perf_counter() - start
    return {"tokens": batch * prompt_len, "seconds": elapsed, "tokens_per_s": batch * prompt_len / elapsed}


def measure_decode(llm: LLM, batch: int, prompt_len: int, decode_tokens: int) -> dict[str, float]:
    """Generated tokens per second after prefill, for ``batch`` concurrent sequences."""
    prompts = _prompts(batch, prompt_len, llm.arch.vocab_size, seed=2)
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


def matmul_gflops(device: torch.device, dtype: torch.dtype, m: int, k: int, n: int) -> float:
    """The machine's dense matmul rate for this shape and dtype (best of 5): the prefill limit."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(6):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


def memcpy_gbps(device: torch.device, nbytes: int) -> float:
    """The machine's copy rate for ``nbytes`` on ``device`` (best of 5): the decode limit (bytes read)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def limits(llm: LLM, sizes: dict[str, int], prefill: dict[str, float], decode: dict[str, float]) -> dict[str, float]:
    """Achieved FLOP/s and bytes/s of the two phases next to the machine's matmul and copy rates."""
    cfg = llm.arch
    params = sum(p.numel() for p in llm.model.parameters())
    layer_params = sum(p.numel() for p in llm.model.model.layers.parameters())
    head = cfg.vocab_size * cfg.hidden_size
    itemsize = llm.pool.layout.itemsize
    batch, t = sizes["batch"], sizes["prompt_len"]
    # Prefill: every decoder-layer weight is a multiply-add per token, the LM head runs for the
    # last token of each prompt only, and causal attention adds 2 * layers * heads * head_dim * T^2
    # per sequence (QK^T and PV over half the square).
    flops = (2 * layer_params * batch * t + 2 * head * batch
             + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * t * t * batch)
    achieved_gflops = flops / prefill["seconds"] / 1e9
    peak_gflops = matmul_gflops(llm.pool.device, llm.pool.layout.torch_dtype, min(batch * t, sizes["budget"]),
                                cfg.hidden_size, cfg.intermediate_size)
    # Decode: each step reads every weight once and the KV of every sequence so far.
    ctx = t + sizes["decode_tokens"] // 2
    step_bytes = params * itemsize + batch * ctx * llm.pool.layout.bytes_per_token
    achieved_gbps = step_bytes / (decode["ms_per_step"] / 1000) / 1e9
    copy_gbps = memcpy_gbps(llm.pool.device, max(step_bytes, 1 << 20))
    return {"prefill_gflops": achieved_gflops, "matmul_gflops": peak_gflops,
            "prefill_vs_matmul": achieved_gflops / peak_gflops,
            "decode_gbps": achieved_gbps, "memcpy_gbps": copy_gbps, "decode_vs_memcpy": achieved_gbps / copy_gbps}


def plot(result: dict, path: Path) -> None:
    """Tokens/s of both phases, and each phase's rate next to the machine's limit."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kvstore.bench.plots import grid, grouped_bars, save

    lim = result["limits"]
    fig, (ax_t, ax_l) = grid(2, f"Engine throughput ({result['device']}, {result['backend']}, {result['dtype']})",
                             ncols=2)
    grouped_bars(ax_t, ["prefill", "decode"], {"tokens/s": [result["prefill"]["tokens_per_s"],
                                                            result["decode"]["tokens_per_s"]]}, "tokens/s")
    grouped_bars(ax_l, [f"prefill GFLOP/s\n{lim['prefill_vs_matmul']:.0%} of matmul",
                        f"decode GB/s\n{lim['decode_vs_memcpy']:.0%} of memcpy"],
                 {"engine": [lim["prefill_gflops"], lim["decode_gbps"]],
                  "machine limit": [lim["matmul_gflops"], lim["memcpy_gbps"]]}, "rate")
    save(fig, path)


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
    parser.add_argument("--out", type=Path, default=None,
                        help="write the results as JSON to this file, and the plot next to it (.png)")
    args = parser.parse_args(argv)

    sizes = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in PRESETS[args.preset].items()}
    arch = None if args.model else ModelArch.tiny(
        num_layers=sizes["layers"], hidden_size=sizes["hidden"], num_heads=sizes["heads"],
        num_kv_heads=sizes["kv_heads"], head_dim=sizes["hidden"] // sizes["heads"],
        intermediate_size=sizes["intermediate"], vocab_size=32000)
    per_seq_blocks = -(-(sizes["prompt_len"] + sizes["decode_tokens"]) // args.block_size)
    config = EngineConfig(block_size=args.block_size, num_gpu_blocks=per_seq_blocks * sizes["batch"] + 8,
                          max_num_batched_tokens=sizes["budget"], max_num_seqs=sizes["batch"],
                          backend=args.backend, dtype=args.dtype, device=args.device)
    llm = LLM(args.model, config=config, arch=arch)
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
        "limits": limits(llm, sizes, prefill, decode),
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
