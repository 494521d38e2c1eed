"""vLLM end to end on a GPU with kvstore: greedy output with each adapter equals output without kvstore.

Run by ``benchmarks/gpu_check.sh`` in an environment holding vLLM 0.33.0 with
its own CUDA dependencies and kvstore (``pip install --no-deps -e .``). It
builds a small Llama with random weights (seeded, saved to a temporary
directory: nothing is downloaded), then for a batch of prompts that share
prefixes:

1. vLLM without a connector and without prefix caching: the reference.
2. Adapter (1), ``KVStoreOffloadingConnector`` with kvstore (embedded LMDB) as
   the secondary tier: the prompts twice, with vLLM's prefix cache and CPU
   tier reset in between, so the second pass loads from kvstore.
3. Adapter (2), ``KVStoreConnector`` over a ``kvstore serve`` daemon: the
   prompts twice, with vLLM's prefix cache reset in between, so the second
   pass loads every full block from kvstore layer by layer.

Every pass must produce the reference token ids exactly; the script exits 1
naming the first mismatch. Results go to ``$OUT/vllm_gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: one CUDA context

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
READY = re.compile(r"listening on unix:(\S+) ")


def make_model(root: Path) -> Path:
    """A 4-layer Llama (2 KV heads, head_dim 64) with seeded random weights, saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048, dtype="float16",
                      bos_token_id=1, eos_token_id=2)
    path = root / "tiny-llama-random"
    model = LlamaForCausalLM(cfg)
    model.half()
    model.save_pretrained(path)
    return path


def prompts() -> list[list[int]]:
    """Eight prompts: two shared 160-token system prefixes, each with four different tails."""
    out = []
    for s in range(2):
        system = [(7 * i + 13 * s) % 2000 + 3 for i in range(160)]
        for t in range(4):
            out.append(system + [(11 * i + 31 * t) % 2000 + 3 for i in range(37 + 5 * t)])
    return out


def generate(llm: Any, batch: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine(model: Path, kv_transfer_config: dict[str, Any] | None) -> Any:
    from vllm import LLM

    return LLM(model=str(model), skip_tokenizer_init=True, dtype="float16", block_size=BLOCK,
               gpu_memory_utilization=0.3, max_model_len=1024, enforce_eager=True, seed=0,
               enable_prefix_caching=kv_transfer_config is not None, kv_transfer_config=kv_transfer_config)


def close(llm: Any) -> None:
    import gc

    import torch

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def check(name: str, got: list[list[int]], want: list[list[int]]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            sys.exit(f"vllm_gpu_check: {name}: prompt {i} generated {g} instead of {w}")
    print(f"{name}: {len(got)} outputs equal to the reference", flush=True)


def daemon_layout_section(model: Path) -> dict[str, Any]:
    """The ``model:`` section a daemon needs for KVStoreConnector's blocks of ``model`` (its own derivation)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from connectors.engine_keys import engine_layout

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16)
    layout = engine_layout("vllm-blocks", str(model), str(spec.dtype), BLOCK, spec.page_size_bytes * 4,
                           "layers=4|FullAttentionSpec")
    return {"model_id": layout.model_id, "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim, "block_size": layout.block_size, "dtype": layout.dtype}


def start_daemon(root: Path, model: Path) -> tuple[subprocess.Popen[str], str]:
    import yaml

    config = root / "daemon.yaml"
    config.write_text(yaml.safe_dump({
        "model": daemon_layout_section(model), "host": {"capacity": "256MiB"},
        "disk": {"path": str(root / "daemon-lmdb"), "max_size": "1GiB"},
        "daemon": {"socket_path": str(root / "kvstore.sock")}, "metrics": {"enabled": False}}))
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--config", str(config)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = READY.search(line)
    if match is None:
        proc.kill()
        sys.exit(f"vllm_gpu_check: the daemon did not start: {line!r}")
    return proc, match.group(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = ap.parse_args()
    import yaml

    root = Path(tempfile.mkdtemp(prefix="kvvllm", dir="/tmp"))
    model = make_model(root)
    batch = prompts()
    report: dict[str, Any] = {}

    llm = engine(model, None)
    want = generate(llm, batch)
    close(llm)

    embedded = root / "embedded.yaml"
    embedded.write_text(yaml.safe_dump({"connector": "embedded", "tiers": ["lmdb"],
                                        "disk": {"path": str(root / "lmdb"), "max_size": "1GiB"}}))
    llm = engine(model, {
        "kv_connector": "KVStoreOffloadingConnector", "kv_connector_module_path": "connectors.vllm.offloading",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 256 << 20,
            "secondary_tiers": [{"type": "KVStoreSecondaryTier", "module_path": "connectors.vllm.tiering",
                                 "kvstore_config": str(embedded)}]}})
    t0 = time.perf_counter()
    check("adapter 1 (offloading tier), first pass", generate(llm, batch), want)
    time.sleep(1.0)  # let the GPU->CPU->kvstore cascades of the last step finish
    assert llm.reset_prefix_cache(reset_connector=True)
    check("adapter 1 (offloading tier), after reset", generate(llm, batch), want)
    report["offloading_tier_s"] = time.perf_counter() - t0
    close(llm)

    daemon, socket_path = start_daemon(root, model)
    try:
        sidecar = root / "sidecar.yaml"
        sidecar.write_text(yaml.safe_dump({"connector": "sidecar", "daemon": {"socket_path": socket_path}}))
        llm = engine(model, {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "connectors.vllm.connector",
                             "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                             "kv_connector_extra_config": {"kvstore_config": str(sidecar)}})
        t0 = time.perf_counter()
        check("adapter 2 (KV connector), first pass", generate(llm, batch), want)
        assert llm.reset_prefix_cache()
        check("adapter 2 (KV connector), after reset", generate(llm, batch), want)
        report["kv_connector_s"] = time.perf_counter() - t0
        close(llm)
    finally:
        daemon.terminate()
        daemon.wait(30)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "vllm_gpu_check.json").write_text(json.dumps({"ok": True, **report}, indent=2))
    print("vllm_gpu_check: OK")


if __name__ == "__main__":
    main()
