"""``kvstore generate`` through its own parser (register + func), as the CLI wires it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineConfig, ModelArch, SamplingParams
from engine.weights import build_model, init_random, save_checkpoint
from kvstore.cli import generate_cmd


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvstore")
    generate_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", *argv])
    return args.func(args)


def test_generate_json_matches_the_api(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = build_model(ModelArch.tiny(), torch.float32, "cpu")
    init_random(model, 11)
    save_checkpoint(model, tmp_path)
    assert _run(["--model", str(tmp_path), "--max-tokens", "4", "--ignore-eos", "--json", "--block-size", "4",
                 "hi there", "x"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expect = LLM(tmp_path, config=EngineConfig(block_size=4)).generate(
        ["hi there", "x"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [d["token_ids"] for d in lines] == [o.token_ids for o in expect]
    assert [d["prompt"] for d in lines] == ["hi there", "x"]
    assert lines[0]["prefill_tokens_computed"] == 9 and lines[0]["cached_tokens"] == 0


def test_generate_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--model", str(tmp_path), "hi"]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert _run(["--top-p", "0", "hi"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_every_flag_has_help() -> None:
    parser = argparse.ArgumentParser(prog="kvstore")
    sub = parser.add_subparsers()
    generate_cmd.register(sub)
    gen = sub.choices["generate"]
    assert all(action.help for action in gen._actions)


def test_text_output_labels_each_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--model", "builtin", "--max-tokens", "3", "--ignore-eos", "--block-size", "4", "hi", "x"]) == 0
    expect = LLM(config=EngineConfig(block_size=4)).generate(["hi", "x"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert capsys.readouterr().out == "".join(f"[{i}] {p}\n{o.text.strip()}\n\n"
                                              for i, (p, o) in enumerate(zip(["hi", "x"], expect), start=1))


def test_truncated_safetensors_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = build_model(ModelArch.tiny(), torch.float32, "cpu")
    init_random(model, 1)
    save_checkpoint(model, tmp_path)
    weights = tmp_path / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert _run(["--model", str(tmp_path), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {weights}: not a readable safetensors file (")
    assert err.count("\n") == 1


def test_garbage_tokenizer_json_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = build_model(ModelArch.tiny(), torch.float32, "cpu")
    init_random(model, 1)
    save_checkpoint(model, tmp_path)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("not json {")
    assert _run(["--model", str(tmp_path), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tokenizer}: not a valid tokenizer.json (")
    assert err.count("\n") == 1


def test_non_utf8_prompt_is_a_one_line_error() -> None:
    # Through a real argv: only there does Python turn the byte 0xff into the surrogate U+DCFF.
    out = subprocess.run([sys.executable, "-m", "kvstore", "generate", "--model", "builtin", "ok", b"a\xffb"],
                         capture_output=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.decode() == ("error: prompt 2 is not valid UTF-8 (byte 0xff at character 1); "
                                   "pass prompts in UTF-8 (check the terminal's locale)\n")
    assert out.stdout == b""
