"""The correctness oracle: output with a prefix from any tier equals output computed from scratch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from connlib import GREEDY, capture_logits, embedded, make_llm, prompt

from engine.config import ModelArch

PROMPT = prompt(1, 45)  # 11 full blocks of 4 and one partial


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], torch.Tensor]:
    llm = make_llm(None)
    logits = capture_logits(llm)
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.metrics.num_cached_tokens == 0
    return out.token_ids, logits[out.request_id]


def _second_run(llm, offload: tuple[str, ...] = (), flush_first: bool = False):  # noqa: ANN001, ANN202
    """Run PROMPT, move its blocks down through ``offload``, flush, and run it again. ``flush_first``: flush before
    the offloads too (every block then on disk: under write_back a GPU victim the disk holds is freed)."""
    first = llm.generate([PROMPT], GREEDY)[0]
    conn = embedded(llm)
    if flush_first:
        conn.flush()
    conn.store.spiller.wait()  # the write policy's copies are made; a flush now would put every block on disk
    for tier in offload:
        conn.offload(tier)
    conn.flush()  # durable where it now is (under write_back a block on disk would never be moved up to host)
    store = conn.store  # internals, only to check them
    store.check_integrity()
    logits = capture_logits(llm)
    second = llm.generate([PROMPT], GREEDY)[0]
    store.check_integrity()
    return first, second, logits[second.request_id]


def _assert_same(out, logits, reference) -> None:  # noqa: ANN001
    ref_ids, ref_logits = reference
    assert out.token_ids == ref_ids
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_recompute_with_connector_matches(tmp_path: Path, reference) -> None:  # noqa: ANN001
    llm = make_llm(tmp_path)
    logits = capture_logits(llm)
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.metrics.num_cached_tokens == 0
    _assert_same(out, logits[out.request_id], reference)


def test_prefix_from_gpu(tmp_path: Path, reference) -> None:  # noqa: ANN001
    first, second, logits = _second_run(make_llm(tmp_path))
    assert second.metrics.cached_tokens_by_tier == {"gpu": 44, "host": 0, "disk": 0}
    assert second.metrics.num_prefill_tokens_computed == 1
    _assert_same(second, logits, reference)


def test_prefix_from_host(tmp_path: Path, reference) -> None:  # noqa: ANN001
    _, second, logits = _second_run(make_llm(tmp_path, write="write_back"), offload=("gpu",))
    assert second.metrics.cached_tokens_by_tier == {"gpu": 0, "host": 44, "disk": 0}
    _assert_same(second, logits, reference)


@pytest.mark.parametrize("codec", ["none", "zstd", "shuffle_zstd"])
def test_prefix_from_disk(tmp_path: Path, reference, codec: str) -> None:  # noqa: ANN001
    _, second, logits = _second_run(make_llm(tmp_path, codec=codec, write="write_back"), offload=("gpu", "host"))
    assert second.metrics.cached_tokens_by_tier == {"gpu": 0, "host": 0, "disk": 44}
    _assert_same(second, logits, reference)


@pytest.mark.parametrize("write", ["write_through", "write_back"])  # write_back: the default, blocks on the GPU at flush
def test_prefix_from_disk_after_restart(tmp_path: Path, reference, write: str) -> None:  # noqa: ANN001
    here = Path(__file__).parent
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(here)!r})
        from pathlib import Path
        from connlib import GREEDY, make_llm, prompt
        llm = make_llm(Path({str(tmp_path)!r}), codec="zstd", write={write!r})
        out = llm.generate([prompt(1, 45)], GREEDY)[0]
        llm.connector.flush()
        print(out.token_ids)
        import os; os._exit(0)  # no close(): what was flushed must be enough
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONHASHSEED="77"))
    assert res.returncode == 0, res.stderr
    llm = make_llm(tmp_path, codec="zstd")
    logits = capture_logits(llm)
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.metrics.cached_tokens_by_tier == {"gpu": 0, "host": 0, "disk": 44}
    _assert_same(out, logits[out.request_id], reference)
    assert str(out.token_ids) == res.stdout.strip()


def test_tenant_salt_isolates(tmp_path: Path, reference) -> None:  # noqa: ANN001
    llm = make_llm(tmp_path)
    llm.generate([PROMPT], GREEDY, cache_salt="tenant-a")
    other = llm.generate([PROMPT], GREEDY, cache_salt="tenant-b")[0]
    unsalted = llm.generate([PROMPT], GREEDY)[0]
    same = llm.generate([PROMPT], GREEDY, cache_salt="tenant-a")[0]
    assert other.metrics.num_cached_tokens == 0
    assert unsalted.metrics.num_cached_tokens == 0
    assert same.metrics.num_cached_tokens == 44
    for out in (other, unsalted, same):
        assert out.token_ids == reference[0]


@pytest.mark.parametrize(("offload", "tier"), [(("gpu",), "disk"), (("gpu", "host"), "disk")])
def test_prefix_from_exclusive_tiers(tmp_path: Path, reference, offload: tuple[str, ...], tier: str) -> None:  # noqa: ANN001
    """Exclusive tiers (``policy.placement: adaptive`` under ``write: write_back``, the default: one duel for host
    and disk, counts carried): the first run's flush wrote the prefix to disk, so a GPU victim the disk holds is
    freed, not copied into host; the output from disk equals the recompute oracle, and the loaded prefix is in
    no host slot while its acknowledged disk copy stays."""
    llm = make_llm(tmp_path, host={"capacity": 64 * 2048}, policy={"write": "write_back", "placement": "adaptive"})
    _, second, logits = _second_run(llm, offload=offload, flush_first=True)
    assert second.metrics.cached_tokens_by_tier == {"gpu": 0, "host": 0, "disk": 0, tier: 44}
    _assert_same(second, logits, reference)
    store = embedded(llm).store
    store.spiller.wait()
    keys = store.keys(PROMPT)[:11]
    assert store.h.host is not None and store.h.disk is not None
    assert not any(store.h.host.contains(k) for k in keys) and all(store.h.disk.contains(k) for k in keys)


WINDOWED = {
    "every-layer-window-6": ModelArch(**{**ModelArch.tiny().__dict__, "sliding_window": 6}),
    "window-then-full": ModelArch(**{**ModelArch.tiny().__dict__, "sliding_window": 6,
                                     "layer_types": ("sliding_attention", "full_attention")}),
}
"""Sliding-window models (Mistral-style, Gemma-style alternation): windows shorter than the 44 cached tokens."""


@pytest.mark.parametrize("arch", list(WINDOWED), ids=list(WINDOWED))
@pytest.mark.parametrize("tier", ["gpu", "host", "disk"])
def test_a_sliding_window_models_prefix_from_every_tier_equals_recompute(tmp_path: Path, arch: str,
                                                                        tier: str) -> None:
    oracle = make_llm(None, arch=WINDOWED[arch])
    oracle_logits = capture_logits(oracle)
    ref = oracle.generate([PROMPT], GREEDY)[0]
    full = make_llm(None)  # the same weights without windows compute other logits: the windows are in effect
    full_logits = capture_logits(full)
    plain = full.generate([PROMPT], GREEDY)[0]
    assert not torch.allclose(full_logits[plain.request_id], oracle_logits[ref.request_id], atol=1e-3)
    offload = {"gpu": (), "host": ("gpu",), "disk": ("gpu", "host")}[tier]
    llm = make_llm(tmp_path, arch=WINDOWED[arch], write="write_back")
    _, second, logits = _second_run(llm, offload)
    assert second.metrics.cached_tokens_by_tier[tier] == 44
    _assert_same(second, logits, (ref.token_ids, oracle_logits[ref.request_id]))
    # Blocks wholly before the first uncached token's window are never read when every layer is windowed:
    # the first query (token 44) reads keys 39-44 in every layer, so of the 11 cached blocks only 9 and 10
    # (tokens 36-43) are loaded. One full-attention layer reads them all.
    store = embedded(llm).store
    loaded = store.h.counters.loaded_blocks.get(tier, 0)
    skipped = 9 if arch == "every-layer-window-6" else 0
    assert loaded == (0 if tier == "gpu" else 11 - skipped)
    # The blocks held without data were never recorded as GPU copies (the engine committed its whole table).
    keys = store.keys(PROMPT)[:11]
    assert [store.h.index.get(k).gpu_block is not None for k in keys] == [tier == "gpu" or i >= skipped
                                                                          for i in range(11)]
    assert not store.h.placeholders
    again = llm.generate([PROMPT], GREEDY)[0]  # served again, from the same mix of GPU and lower-tier copies
    assert again.token_ids == ref.token_ids and again.metrics.num_cached_tokens == 44
