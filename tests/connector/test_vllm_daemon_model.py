"""``python -m connectors.vllm.daemon_model``: the daemon ``model:`` section for vLLM blocks, from config.json alone.

Whether vLLM's own connector agrees is shown by every real-engine test (the daemon refuses any other
section); here: the section's shape, what goes into its model id, and bad input.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from connectors.vllm.daemon_model import vllm_daemon_model
from kvstore.layout import KVLayout

CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
          "head_dim": 64}


def _model(root: Path, **over: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**CONFIG, **over}))
    return root


def test_the_section_sizes_one_vllm_block_of_every_layer_and_names_the_kv_format(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    fp32 = KVLayout(**vllm_daemon_model(model, "float32", 32))
    assert fp32.block_size == 32 and fp32.bytes_per_block == 30 * 2 * 32 * 3 * 64 * 4  # K and V, every layer
    assert "kv=auto|tensor=float32" in fp32.model_id and str(tmp_path) not in fp32.model_id  # no path in it
    e4m3, e5m2 = (KVLayout(**vllm_daemon_model(model, "bfloat16", 32, kind)) for kind in ("fp8_e4m3", "fp8_e5m2"))
    assert e4m3.bytes_per_block == e5m2.bytes_per_block == fp32.bytes_per_block // 4  # both stored as uint8
    assert e4m3.fingerprint != e5m2.fingerprint  # ... yet never one identity
    other = KVLayout(**vllm_daemon_model(_model(tmp_path / "n", num_hidden_layers=29), "float32", 32))
    assert other.fingerprint != fp32.fingerprint


def test_the_command_prints_the_section_and_names_bad_input(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    run = [sys.executable, "-m", "connectors.vllm.daemon_model"]
    ok = subprocess.run([*run, str(model), "--dtype", "float32", "--block-size", "32"], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["model"] == vllm_daemon_model(model, "float32", 32)
    missing = subprocess.run([*run, str(tmp_path / "nowhere"), "--dtype", "float32", "--block-size", "32"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and f"{tmp_path / 'nowhere' / 'config.json'}: cannot read" in missing.stderr
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"hidden_size": 576}))
    bad = subprocess.run([*run, str(tmp_path / "bad"), "--dtype", "float32", "--block-size", "32"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "has no 'num_hidden_layers'" in bad.stderr and "Traceback" not in bad.stderr
