"""engine/hf_export.py: the default GGUF as a Hugging Face directory is the same model, and is made once.

vLLM loads only Hugging Face checkpoints, so the real-engine suite runs the
exported directory; these checks tie it to what kvstore's own engine runs
from the GGUF: equal weights, the same tokenizer ids and chat template, and a
stamp that makes a second export a no-op.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import CheckpointError
from engine.default_model import default_model_path
from engine.gguf_file import GGUFFile
from engine.gguf_loader import config_from_gguf, load_gguf_weights
from engine.gguf_tokenizer import tokenizer_from_gguf
from engine.hf_export import STAMP, export_hf
from engine.weights import build_model


def test_the_exported_checkpoint_is_the_ggufs_model_and_is_reused(tmp_path: Path) -> None:
    gguf_path = default_model_path()
    out = export_hf(gguf_path, tmp_path / "hf")
    gguf = GGUFFile(gguf_path)
    model = build_model(config_from_gguf(gguf), torch.float32, "cpu")
    load_gguf_weights(model, gguf)
    exported = load_file(str(out / "model.safetensors"))
    expected = dict(model.named_parameters())
    assert set(exported) == set(expected)  # tied embeddings: no separate lm_head.weight, as Hugging Face saves it
    assert all(torch.equal(exported[name], p.detach()) for name, p in expected.items())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config

    from tokenizers import Tokenizer

    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    ours = tokenizer_from_gguf(gguf).encode(text).ids
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == ours
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == gguf.field("tokenizer.chat_template")

    stamp = (out / STAMP).stat().st_mtime_ns
    weights = (out / "model.safetensors").stat().st_mtime_ns
    assert export_hf(gguf_path, out) == out  # the same source: reused as it is
    assert ((out / STAMP).stat().st_mtime_ns, (out / "model.safetensors").stat().st_mtime_ns) == (stamp, weights)


def test_exporting_something_that_is_not_a_gguf_file_names_it(tmp_path: Path) -> None:
    bogus = tmp_path / "model.bin"
    bogus.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="model.bin: not a GGUF file"):
        export_hf(bogus, tmp_path / "hf")
