"""The capacity planner's arithmetic and CLI, and the vLLM-style hashing baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.bench.planner import load_model, make_plan
from kvstore.bench.vllm_hash_baseline import VLLMPrefixCache, vllm_block_hashes


def test_llama_70b_bf16_kv_size() -> None:
    m = load_model("llama-3.1-70b")
    assert m.bytes_per_token == 327_680  # 0.3125 MiB
    assert 131072 * m.bytes_per_token == 40 * 2**30
    assert m.layout(16).bytes_per_block == 16 * m.bytes_per_token


def test_plan_tokens_and_load_time() -> None:
    m = load_model("llama-3.1-8b")
    rows = make_plan(m, 1 << 30, 2 << 30, 0, host_gbps=10.0, disk_gbps=1.0, prefix_tokens=1000).rows()
    assert [r["tokens"] for r in rows] == [8192, 16384, 0]
    assert rows[1]["prefix_load_s"] == pytest.approx(1000 * 131072 / 10e9)


def test_hf_config_json(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512,
                               "num_key_value_heads": 2, "torch_dtype": "float16"}))
    m = load_model(str(cfg))
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.bytes_per_token) == (2, 2, 64, 2 * 2 * 2 * 64 * 2)
    with pytest.raises(ValueError, match="neither a preset"):
        load_model(str(tmp_path / "nope.json"))


def test_plan_cli_prints_the_table() -> None:
    res = subprocess.run([sys.executable, "-m", "kvstore", "plan", "--model", "llama-3.1-70b", "--gpu-mem", "40GiB",
                          "--host-mem", "256GiB", "--disk-size", "2TB", "--host-bw", "10", "--disk-bw", "2"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "327,680 B" in res.stdout and "40.00 GiB" in res.stdout and "131,072" in res.stdout
    capacities = {line.split()[0]: line.split()[1] for line in res.stdout.splitlines()
                  if line.split()[:1] in (["gpu"], ["host"], ["disk"])}
    assert capacities == {"gpu": "40GiB", "host": "256GiB", "disk": "2TB"}  # as given, not 1862.6 GiB
    bad = subprocess.run([sys.executable, "-m", "kvstore", "plan", "--model", "no-such-model"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "neither a preset" in bad.stderr


def test_vllm_baseline_chain_and_match() -> None:
    tokens = list(range(100))
    hashes = vllm_block_hashes(tokens, 16)
    assert len(hashes) == 6 and len(set(hashes)) == 6
    assert vllm_block_hashes(tokens[:40], 16) == hashes[:2]
    cache = VLLMPrefixCache(16)
    cache.insert(tokens[:64])
    assert cache.match(tokens) == 4
    assert cache.match([7] + tokens[1:]) == 0
