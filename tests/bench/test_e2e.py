"""The ``e2e`` suite: its model and sizes, its prompts, and the checks that make a wrong cache fail the run.

The quick run itself (schema, plot, no scratch left) is in test_suites_quick.py;
timings are never asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.default_model import GGUF_NAME, resolve_model
from engine.tokenizer import ByteTokenizer
from kvstore.store import prefetch
from kvstore.bench.e2e import E2EPlan, plan
from kvstore.bench.e2e_check import RunRecord, check_run
from kvstore.bench.e2e_prompts import build_prompts, document
from kvstore.bench.harness import SuiteError, SuiteOptions
from kvstore.cli.main import build_parser, main
from kvstore.layout import KVLayout


def _plan_from_cli(argv: list[str], out: Path) -> E2EPlan:
    """The plan ``kvstore bench e2e ARGV`` would run, from the real parser, without running it."""
    args = build_parser().parse_args(["bench", "e2e", *argv])
    return plan(SuiteOptions(out_dir=out, quick=args.quick, model=args.model, prefix_tokens=args.prefix_tokens,
                             repeats=args.repeats))


def test_default_run_is_on_smollm2(tmp_path: Path) -> None:
    p = _plan_from_cli([], tmp_path)
    assert p == E2EPlan(model="default", prefix_tokens=2048, repeats=5, max_tokens=16, block_size=32, quick=False)
    path = resolve_model(p.model)
    assert isinstance(path, Path) and path.name == GGUF_NAME


def test_quick_and_builtin_use_the_tiny_model_and_flags_override(tmp_path: Path) -> None:
    assert _plan_from_cli(["--quick"], tmp_path) == E2EPlan("builtin", 512, 2, 4, 128, True)
    assert _plan_from_cli(["--model", "builtin"], tmp_path) == E2EPlan("builtin", 4096, 5, 8, 128, False)
    assert _plan_from_cli(["--quick", "--model", "default"], tmp_path) == E2EPlan("default", 256, 2, 4, 32, True)
    assert _plan_from_cli(["--prefix-tokens", "1024", "--repeats", "3"], tmp_path) == \
        E2EPlan("default", 1024, 3, 16, 32, False)
    assert resolve_model(_plan_from_cli(["--quick"], tmp_path).model) is None  # LLM(None): the built-in model


def _record(output: tuple[int, ...], cached: dict[str, int], computed: int, prompt: int = 100) -> RunRecord:
    return RunRecord(ttft_s=0.1, output_ids=output, cached_by_tier={"gpu": 0, "host": 0, "disk": 0, **cached},
                     computed_tokens=computed, prompt_tokens=prompt)


def test_check_run_accepts_what_each_mode_claims() -> None:
    ref = _record((5, 6, 7), {}, 100)
    check_run("recompute", "repeat 1", ref, None, 96)
    for tier in ("gpu", "host", "disk"):
        check_run(tier, "repeat 1", _record((5, 6, 7), {tier: 96}, 4), ref, 96)


def test_a_cached_output_that_differs_from_recompute_fails_naming_mode_and_position() -> None:
    ref = _record((5, 6, 7), {}, 100)
    with pytest.raises(SuiteError, match=r"repeat 2, mode host: output tokens differ from recompute at "
                                         r"position 1: \[5, 9, 7\] != \[5, 6, 7\]"):
        check_run("host", "repeat 2", _record((5, 9, 7), {"host": 96}, 4), ref, 96)
    with pytest.raises(SuiteError, match="at position 2"):  # one output cut short
        check_run("disk", "repeat 1", _record((5, 6), {"disk": 96}, 4), ref, 96)


def test_a_run_that_did_not_measure_its_tier_fails() -> None:
    ref = _record((5,), {}, 100)
    with pytest.raises(SuiteError, match=r"mode disk: expected the 96-token prefix served from disk and 4 tokens "
                                         r"computed, got cached \{'host': 96\} and 4 computed"):
        check_run("disk", "repeat 1", _record((5,), {"host": 96}, 4), ref, 96)
    with pytest.raises(SuiteError, match=r"got cached \{\} and 100 computed"):  # a miss is not a hit
        check_run("gpu", "repeat 1", _record((5,), {}, 100), ref, 96)
    with pytest.raises(SuiteError, match=r"mode recompute: expected all 100 prompt tokens computed"):
        check_run("recompute", "repeat 1", _record((5,), {"gpu": 32}, 68), None, 96)


def test_prompts_are_the_document_then_a_question_that_fits_in_the_partial_block() -> None:
    tok = ByteTokenizer()
    prompts = build_prompts(tok, None, prefix_tokens=512, block_size=128, repeats=3)
    assert len(prompts.prefix) == 512 and prompts.prefix[0] == ByteTokenizer.BOS
    assert all(0 < len(s) < 128 for s in [*prompts.suffixes, prompts.first_sight])
    assert len(prompts.suffixes) == len(prompts.questions) == 3
    text = tok.decode(prompts.prefix + prompts.suffixes[1])
    assert document()[:300] in text and text.endswith(f"Question: {prompts.questions[1]}\nAnswer:")
    assert ByteTokenizer.BOS not in prompts.suffixes[0]  # a continuation carries no second BOS
    assert prompts.warmup[:128] != prompts.prefix[:128]  # the warm-up caches no block of the prefix


def test_prompt_sizes_that_cannot_work_are_refused() -> None:
    tok = ByteTokenizer()
    with pytest.raises(SuiteError, match=r"prefix of 500 tokens \(--prefix-tokens\) must be a positive multiple "
                                         r"of the block size 128"):
        build_prompts(tok, None, prefix_tokens=500, block_size=128, repeats=1)
    with pytest.raises(SuiteError, match=r"question suffix of \d+ tokens does not fit in one block of 32"):
        build_prompts(tok, None, prefix_tokens=512, block_size=32, repeats=1)
    with pytest.raises(SuiteError, match="the document has"):
        build_prompts(tok, None, prefix_tokens=128 * 1024, block_size=128, repeats=1)


def test_a_tier_returning_wrong_kv_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Fault injection: every load from host RAM or disk into the block pool zeroes the bytes it copied."""
    real = prefetch.copy_layer

    def zeroing_copy(layout: KVLayout, dsts: list[torch.Tensor], srcs: list[torch.Tensor], layer: int) -> None:
        real(layout, dsts, srcs, layer)
        size = layout.bytes_per_block // layout.num_layers
        for dst in dsts:
            dst[layer * size:(layer + 1) * size].zero_()

    monkeypatch.setattr(prefetch, "copy_layer", zeroing_copy)
    out = tmp_path / "out"
    code = main(["bench", "e2e", "--quick", "--no-progress", "--repeats", "1", "--prefix-tokens", "256",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    assert "error: bench e2e: repeat 1, mode host: output tokens differ from recompute at position" in err
    assert not (out / "results.json").exists()
    assert [p.name for p in out.iterdir()] == [], "scratch data must be removed"


def test_a_missing_model_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "absent.gguf"
    code = main(["bench", "e2e", "--quick", "--no-progress", "--model", str(missing), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"error: bench e2e: model '{missing}': ") and err.count("\n") == 1, err
