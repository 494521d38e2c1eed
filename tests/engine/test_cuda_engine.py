"""End-to-end generation on CUDA: Triton (auto) and torch backends agree; bf16 runs. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_triton_and_torch_backends_agree_on_cuda() -> None:
    prompts = [list(range(1, 1 + n)) for n in (3, 40, 129, 17)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("auto", "torch"):
        llm = LLM(config=EngineConfig(block_size=16, num_gpu_blocks=64, max_num_batched_tokens=96,
                                      backend=backend, dtype="float32", device="cuda"))
        assert llm.runner.backend.name == ("triton" if backend == "auto" else "torch")
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["auto"] == outs["torch"]


def test_bfloat16_generation_runs_on_cuda() -> None:
    llm = LLM(config=EngineConfig(device="cuda"))
    assert llm.pool.layout.dtype == "bfloat16" and llm.pool.kv.is_cuda
    outs = llm.generate(["hello", "a longer prompt " * 20], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8]
    llm.pool.check_integrity()
