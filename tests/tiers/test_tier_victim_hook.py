"""The victim hook of the LMDB, file and slab tiers: a capacity eviction shows its victims, still readable, before
deleting them; the hook's send runs once they are gone; a failing hook never fails the put."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from tiers_testlib import empty_blocks, make_blocks, make_keys

from kvstore.layout import KVLayout
from kvstore.tiers.base import BlockReader, Tier, VictimSend
from kvstore.tiers.lmdb.tier import DiskTier
from kvstore.tiers.file import FileTier
from kvstore.tiers.host.tier import HostTier
from kvstore.tiers.slab.tier import SlabTier


def _tier(kind: str, layout: KVLayout, root: Path) -> Tier:
    """A tier of a few blocks: 4 files, 4 slots, or an LMDB map of 21 pages."""
    if kind == "file":
        return FileTier(layout, root / "files", 4 * 4096)
    if kind == "slab":
        return SlabTier(layout, root / "slab", 4 * 4096)
    return DiskTier(layout, root / "lmdb", 21 * 4096)


@pytest.mark.parametrize("kind", ["file", "lmdb", "slab"])
def test_victims_are_read_before_they_go_and_sent_after(tmp_path: Path, layout: KVLayout, kind: str) -> None:
    tier = _tier(kind, layout, tmp_path)
    keys, blocks = make_keys(layout, 12), make_blocks(layout, 12)
    by_key = dict(zip(keys, blocks))
    seen: list[bytes] = []
    sent: list[bytes] = []

    def hook(victims: Sequence[bytes], read: BlockReader) -> VictimSend:
        bufs = empty_blocks(layout, len(victims))
        assert read(victims, bufs) == [True] * len(victims)  # still there, verified
        assert all(torch.equal(b, by_key[k]) for k, b in zip(victims, bufs))
        seen.extend(victims)
        return lambda: sent.extend(k for k in victims if not tier.contains(k))  # gone by now

    tier.set_victim_hook(hook)
    for key, block in zip(keys, blocks):
        assert tier.put([key], [block]) == [True]
    evicted = [ev.key for ev in tier.drain_events() if ev.kind == "evicted"]
    assert seen == evicted and sent == evicted and len(evicted) == tier.stats().evictions > 0
    if kind in ("file", "slab"):
        assert evicted == keys[:8]  # least recently used first, exactly
    tier.set_victim_hook(None)
    tier.put(make_keys(layout, 4, seed=1), make_blocks(layout, 4, seed=1))
    assert len(seen) == len(evicted)  # no hook, no calls
    tier.close()


@pytest.mark.parametrize("kind", ["file", "lmdb", "slab"])
def test_a_failing_hook_never_fails_the_eviction(tmp_path: Path, layout: KVLayout, kind: str) -> None:
    tier = _tier(kind, layout, tmp_path)

    def hook(victims: Sequence[bytes], read: BlockReader) -> VictimSend:
        raise RuntimeError("the owner broke")

    tier.set_victim_hook(hook)
    keys, blocks = make_keys(layout, 12), make_blocks(layout, 12)
    assert all(tier.put([k], [b]) == [True] for k, b in zip(keys, blocks))
    st = tier.stats()
    assert st.evictions == 12 - st.num_blocks > 0
    tier.close()


def test_tiers_that_do_not_evict_inside_put_refuse_a_hook(layout: KVLayout) -> None:
    host = HostTier(layout, 4 * layout.bytes_per_block)
    assert not host.takes_victim_hook
    with pytest.raises(NotImplementedError, match="host"):
        host.set_victim_hook(lambda victims, read: None)
    host.close()
