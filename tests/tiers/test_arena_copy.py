"""The arena's block copies (raw ``memmove`` per slot) and the buffer check that hands them addresses."""

from __future__ import annotations

import pytest
import torch

from kvstore.errors import TierError
from kvstore.tiers.host.arena import HostArena, copy_runs
from kvstore.tiers.base import buffer_addresses, check_buffers

BPB = 4096


def _blocks(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (BPB,), dtype=torch.uint8, generator=g) for _ in range(n)]


def test_write_then_read_slots_exact_bytes_and_nothing_else_touched() -> None:
    arena = HostArena.allocate(8, BPB, pin=False)
    arena.tensor.fill_(7)
    srcs = _blocks(3, 1)
    arena.write_slots([5, 0, 3], buffer_addresses([b"a", b"b", b"c"], srcs, BPB, "host"))
    for slot, src in zip([5, 0, 3], srcs):
        assert torch.equal(arena.slot_view(slot), src)
    for slot in (1, 2, 4, 6, 7):
        assert bool((arena.slot_view(slot) == 7).all())
    dests = [torch.zeros(BPB, dtype=torch.uint8) for _ in range(3)]
    arena.read_slots([3, 5, 0], buffer_addresses([b"x"] * 3, dests, BPB, "host"))
    assert [torch.equal(d, s) for d, s in zip(dests, [srcs[2], srcs[0], srcs[1]])] == [True, True, True]
    arena.close()


def test_runs_of_consecutive_slots_and_addresses_are_one_copy_each() -> None:
    a = 1000
    assert copy_runs([], [], BPB) == []
    assert copy_runs([3, 4, 5, 9, 10, 2], [a, a + BPB, a + 2 * BPB, a + 3 * BPB, a + 5 * BPB, a + 6 * BPB], BPB) == [
        (3, a, 3), (9, a + 3 * BPB, 1), (10, a + 5 * BPB, 1), (2, a + 6 * BPB, 1)]  # a gap in either breaks a run
    assert copy_runs([7, 6], [a, a + BPB], BPB) == [(7, a, 1), (6, a + BPB, 1)]  # descending slots: no run


def test_a_staging_buffer_copied_in_runs_lands_block_by_block() -> None:
    arena = HostArena.allocate(12, BPB, pin=False)
    arena.tensor.fill_(7)
    staging = torch.stack(_blocks(8, 2))  # one contiguous range, as an engine's offload buffer is
    slots = [2, 3, 4, 5, 9, 0, 1, 11]  # runs of 4, 1, 2, 1
    arena.write_slots(slots, buffer_addresses([b"k"] * 8, list(staging), BPB, "host"))
    for i, slot in enumerate(slots):
        assert torch.equal(arena.slot_view(slot), staging[i])
    assert all(bool((arena.slot_view(s) == 7).all()) for s in (6, 7, 8, 10))
    back = torch.zeros_like(staging)
    arena.read_slots(slots, buffer_addresses([b"k"] * 8, list(back), BPB, "host"))
    assert torch.equal(back, staging)
    arena.close()


def test_slot_out_of_range_copies_nothing() -> None:
    arena = HostArena.allocate(4, BPB, pin=False)
    arena.tensor.zero_()
    srcs = _blocks(2, 2)
    addrs = buffer_addresses([b"a", b"b"], srcs, BPB, "host")
    for bad in ([0, 4], [-1, 1]):
        with pytest.raises(IndexError, match=r"slot out of range \[0, 4\)"):
            arena.write_slots(bad, addrs)
        with pytest.raises(IndexError, match=r"slot out of range"):
            arena.read_slots(bad, addrs)
    assert int(arena.tensor.sum()) == 0  # the in-range slot of a refused batch was not written either
    arena.close()


def test_copies_on_a_closed_arena_raise() -> None:
    arena = HostArena.allocate(2, BPB, pin=False)
    arena.close()
    addrs = buffer_addresses([b"a"], _blocks(1, 3), BPB, "host")
    with pytest.raises(TierError, match="closed"):
        arena.write_slots([0], addrs)
    with pytest.raises(TierError, match="closed"):
        arena.read_slots([0], addrs)


@pytest.mark.parametrize("bad", [
    torch.zeros(BPB, dtype=torch.int8),                      # wrong dtype
    torch.zeros(BPB - 1, dtype=torch.uint8),                 # wrong size
    torch.zeros(2 * BPB, dtype=torch.uint8)[::2],            # not contiguous
    torch.zeros(BPB // 2, dtype=torch.int16),                # right bytes, wrong dtype
])
def test_buffer_addresses_refuses_a_bad_buffer_naming_its_key(bad: torch.Tensor) -> None:
    good = torch.zeros(BPB, dtype=torch.uint8)
    key = bytes.fromhex("ab" * 32)
    with pytest.raises(ValueError, match=r"buffer for host block abababababababab… is .*expected contiguous uint8\[4096\] on cpu"):
        buffer_addresses([b"\0" * 32, key], [good, bad], BPB, "host")
    with pytest.raises(ValueError, match="host block abababababababab"):
        check_buffers([b"\0" * 32, key], [good, bad], BPB, "host")


def test_buffer_addresses_counts_and_addresses() -> None:
    bufs = list(torch.zeros((3, BPB), dtype=torch.uint8))
    assert buffer_addresses([b"a", b"b", b"c"], bufs, BPB, "host") == [b.data_ptr() for b in bufs]
    with pytest.raises(ValueError, match="2 keys but 3 buffers"):
        buffer_addresses([b"a", b"b"], bufs, BPB, "host")
