"""``policy.exclusive_tiers``: each block lives in one of GPU, host and disk. A load moves a block up (its host
and disk copies go), an eviction moves it down (GPU -> host -> disk), and every load returns the bytes stored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from kvstore.config.schema import PolicyConfig
from kvstore.gpu_pool import GPUBlockPool
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from storelib import LAYOUT, prefill, read_lease

BS = LAYOUT.block_size


def _toks(start: int, nblocks: int) -> list[int]:
    return list(range(start, start + nblocks * BS))


def _store(root: Path, eviction: str, carry: bool) -> TieredStore:
    pool = GPUBlockPool(LAYOUT, 4, device="cpu")
    host = HostTier(LAYOUT, 2 * LAYOUT.bytes_per_block, auto_evict=False, eviction=eviction)
    disk = DiskTier(LAYOUT, root, 1 << 20, sync="interval", eviction=eviction)
    return TieredStore(LAYOUT, pool, host, disk,
                       PolicyConfig(write="write_back", carry_uses=carry, exclusive_tiers=True))


def _where(s: TieredStore, tokens: list[int]) -> list[tuple[bool, bool, bool]]:
    """(on GPU, in the host tier, in the disk tier) per block, asked of the tiers themselves."""
    s.flush()
    out = []
    for k in s.keys(tokens):
        e = s.index.get(k)
        assert s.h.host is not None and s.h.disk is not None
        out.append((e is not None and e.gpu_block is not None, s.h.host.contains(k), s.h.disk.contains(k)))
    return out


def test_exclusive_needs_write_back() -> None:
    with pytest.raises(ValidationError, match="exclusive_tiers needs policy.write: write_back"):
        PolicyConfig(write="write_through", exclusive_tiers=True)


@pytest.mark.parametrize(("eviction", "carry"), [("lru", False), ("gdsf", True)])
def test_each_block_in_one_tier_and_loads_return_what_was_stored(tmp_path: Path, eviction: str, carry: bool) -> None:
    s = _store(tmp_path, eviction, carry)
    try:
        a = _toks(0, 2)
        stored = prefill(s, a, seed=1)
        truth = {start: prefill(s, _toks(start, 2), seed=start) for start in (100, 200)}  # a: GPU -> host
        assert _where(s, a) == [(False, True, False)] * 2
        data, _ = read_lease(s, a)  # host -> GPU: the host copy goes
        assert all(torch.equal(d, w) for d, w in zip(data, stored))
        assert _where(s, a) == [(True, False, False)] * 2
        for start in (300, 400, 500):  # a goes down again: GPU -> host (written back) -> disk
            truth[start] = prefill(s, _toks(start, 2), seed=start)
        assert _where(s, a) == [(False, False, True)] * 2
        loaded_before = s.h.counters.loaded_blocks["disk"]
        data, _ = read_lease(s, a)  # disk -> GPU, no host copy: the disk copy goes
        assert all(torch.equal(d, w) for d, w in zip(data, stored))
        assert s.h.counters.loaded_blocks["disk"] == loaded_before + 2
        assert _where(s, a) == [(True, False, False)] * 2
        s.check_integrity()
        for start, written in truth.items():  # every other prompt: in exactly one tier, and its bytes intact
            assert all(sum(w) == 1 for w in _where(s, _toks(start, 2))), start
            data, _ = read_lease(s, _toks(start, 2))
            assert len(data) == 2 and all(torch.equal(d, w) for d, w in zip(data, written)), start
            assert _where(s, _toks(start, 2)) == [(True, False, False)] * 2
            s.check_integrity()
    finally:
        s.close()
