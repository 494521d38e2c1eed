"""Host tiers of several KV layouts sharing one budget (``kvstore.tiers.shared_capacity``): a daemon serving any
layout. Together they never hold more than the budget, the layout in use takes room from the idle one, a pinned
block is never taken, and a freed slot's memory goes back to the kernel."""

from __future__ import annotations

import torch

from kvstore.layout import KVLayout
from kvstore.tiers.host.tier import HostTier
from kvstore.tiers.shared_capacity import SharedCapacity

A = KVLayout(2, 2, 64, 16, "float32", "a")  # 32 KiB blocks
B = KVLayout(4, 2, 64, 16, "float32", "b")  # 64 KiB blocks
LIMIT = 1 << 20


def _blocks(layout: KVLayout, n: int, seed: int) -> list[torch.Tensor]:
    return [torch.full((layout.bytes_per_block,), (seed + i) % 251, dtype=torch.uint8) for i in range(n)]


def _keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i % 256]) * 16 for i in range(n)]  # 32-byte keys, as block keys are


def _pair(shared: bool = True) -> tuple[SharedCapacity, HostTier, HostTier]:
    cap = SharedCapacity(LIMIT)
    a = HostTier(A, LIMIT, shared_memory=shared, shared_capacity=cap, label="test-a")
    b = HostTier(B, LIMIT, shared_memory=shared, shared_capacity=cap, label="test-b")
    return cap, a, b


def test_together_never_above_the_budget_and_the_layout_in_use_takes_room_from_the_idle_one() -> None:
    cap, a, b = _pair()
    ka, kb = _keys(1, 32), _keys(2, 12)
    assert all(a.put(ka, _blocks(A, 32, 0)))  # the whole budget
    assert cap.used == LIMIT and a.used_bytes() == LIMIT
    assert all(b.put(kb, _blocks(B, 12, 0)))  # 768 KiB, all of it taken from the idle layout
    assert cap.used <= LIMIT and a.used_bytes() + b.used_bytes() == cap.used
    assert all(b.contains(k) for k in kb) and sum(a.contains(k) for k in ka) == 8
    out = [torch.empty(B.bytes_per_block, dtype=torch.uint8) for _ in kb]
    assert all(b.get(kb, out)) and all(torch.equal(o, x) for o, x in zip(out, _blocks(B, 12, 0)))
    for t in (a, b):
        t.check_integrity()
    a.close()
    assert cap.used == b.used_bytes()  # a closed tier's bytes leave the count
    b.close()
    assert cap.used == 0


def test_a_pinned_block_is_never_taken_and_a_busy_layout_sheds_nothing() -> None:
    cap, a, b = _pair(shared=False)
    ka = _keys(1, 32)
    a.put(ka, _blocks(A, 32, 0))
    a.pin(ka)  # every block of the idle layout is being read
    assert b.put(_keys(2, 4), _blocks(B, 4, 0)) == [False] * 4
    assert all(a.contains(k) for k in ka)
    a.unpin(ka)
    with a._lock:  # noqa: SLF001 - the tier busy in another thread: shedding must not wait for it
        assert a.shed(LIMIT) == 0
    assert all(b.put(_keys(2, 4), _blocks(B, 4, 0)))
    for t in (a, b):
        t.check_integrity()
        t.close()


def test_a_freed_slot_gives_its_memory_back() -> None:
    cap, a, b = _pair()

    def resident_kib() -> int:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["RssShmem"].split()[0])

    base = resident_kib()
    ka = _keys(1, 32)
    a.put(ka, _blocks(A, 32, 0))
    assert resident_kib() - base >= LIMIT // 1024 * 0.9
    a.delete(ka)
    assert resident_kib() - base < LIMIT // 1024 * 0.1 and cap.used == 0
    a.close()
    b.close()
