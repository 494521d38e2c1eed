"""The correctness oracle on the real default model (SmolLM2-135M-Instruct): a prompt prefix loaded from the host
tier or from the LMDB disk tier gives the output computed from scratch, token for token and logit for logit.

``test_connector_oracle.py`` covers every tier and codec on the tiny random model; this runs the two lower tiers
once on real weights (30 layers, grouped-query attention, 16-token blocks). The model loads once for the module.
"""

from __future__ import annotations

import os

import pytest
import torch

from connlib import capture_logits, embedded, kv_config
from connectors.embedded import EmbeddedConnector
from engine import LLM, EngineConfig, SamplingParams
from engine.default_model import default_model_path
from engine.gguf_loader import checkpoint_config
from engine.kv_layout import engine_kv_layout
from engine.outputs import RequestOutput

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)  # a few decode steps read the loaded prefix too
QUESTION = ("In one sentence: what does a key-value cache store in a transformer, and why does reusing a shared "
            "prompt prefix save time?")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """SmolLM2 with an embedded connector over a host tier and an LMDB tier (write-back, so offloading moves
    blocks down one tier at a time)."""
    path = default_model_path()
    config = EngineConfig(block_size=16, num_gpu_blocks=32, device=os.environ.get("KVSTORE_TEST_DEVICE", "cpu"),
                          backend=os.environ.get("KVSTORE_TEST_BACKEND", "torch"),  # type: ignore[arg-type]
                          dtype="float32")
    block_bytes = engine_kv_layout(checkpoint_config(path), config, path).bytes_per_block
    tiers = kv_config(tmp_path_factory.mktemp("smollm2-tiers"), host_blocks=32, block_bytes=block_bytes,
                      write="write_back")
    return LLM(path, config=config, connector=EmbeddedConnector(tiers))


@pytest.fixture(scope="module")
def prompt(smollm2: LLM) -> list[int]:
    """A chat prompt of a few full blocks and a partial one."""
    assert smollm2.chat_template is not None
    ids = smollm2.tokenizer.encode(smollm2.chat_template.user_prompt(QUESTION))
    assert len(ids) >= 3 * 16 and len(ids) % 16, len(ids)
    return ids


def _run(llm: LLM, prompt: list[int], salt: str) -> tuple[RequestOutput, torch.Tensor]:
    logits = capture_logits(llm)
    out = llm.generate([prompt], GREEDY, cache_salt=salt)[0]
    return out, logits[out.request_id]


@pytest.fixture(scope="module")
def reference(smollm2: LLM, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and first-token logits computed from scratch (a salt nothing else uses: no cached block)."""
    out, logits = _run(smollm2, prompt, "reference")
    assert out.metrics.num_cached_tokens == 0 and out.metrics.num_prefill_tokens_computed == len(prompt)
    return out.token_ids, logits


def _cached_from(llm: LLM, prompt: list[int], salt: str, offload: tuple[str, ...]) -> tuple[RequestOutput, torch.Tensor]:
    """Compute ``prompt`` once under ``salt``, move its blocks down through ``offload``, and run it again."""
    first, _ = _run(llm, prompt, salt)
    assert first.metrics.num_cached_tokens == 0  # the salt is new: computed from scratch
    conn = embedded(llm)
    conn.store.spiller.wait()  # the write policy's copies are made; a flush now would put every block on disk
    for tier in offload:
        conn.offload(tier)
    conn.flush()  # durable where it now is (under write_back a block on disk would never be moved up to host)
    second = _run(llm, prompt, salt)
    conn.store.check_integrity()
    return second


def _assert_same(out: RequestOutput, logits: torch.Tensor, reference: tuple[list[int], torch.Tensor]) -> None:
    """Same greedy tokens; first-token logits equal up to float32 rounding.

    With a cached prefix the engine computes only the suffix (11 tokens instead of 59), so its matmuls
    have other shapes and the CPU BLAS picks other kernels and summation orders; over 30 layers that
    moves a logit by a few 1e-5 on some CPUs (2.7e-5 on one of 49,152 logits of magnitude ~14 on this
    project's AMD EPYC VM, under 1e-5 on the CI machine). A wrong or shifted KV block moves logits by
    whole units, so 1e-4 still catches every loading error; the tiny model's oracle keeps 1e-5."""
    ref_ids, ref_logits = reference
    assert out.token_ids == ref_ids
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_prefix_from_host(smollm2: LLM, prompt: list[int], reference: tuple[list[int], torch.Tensor]) -> None:
    out, logits = _cached_from(smollm2, prompt, "host", offload=("gpu",))
    full = len(prompt) // 16 * 16
    assert out.metrics.cached_tokens_by_tier == {"gpu": 0, "host": full, "disk": 0}
    assert out.metrics.num_prefill_tokens_computed == len(prompt) - full
    _assert_same(out, logits, reference)


def test_prefix_from_disk(smollm2: LLM, prompt: list[int], reference: tuple[list[int], torch.Tensor]) -> None:
    out, logits = _cached_from(smollm2, prompt, "disk", offload=("gpu", "host"))
    full = len(prompt) // 16 * 16
    assert out.metrics.cached_tokens_by_tier == {"gpu": 0, "host": 0, "disk": full}
    assert out.metrics.num_prefill_tokens_computed == len(prompt) - full
    _assert_same(out, logits, reference)
