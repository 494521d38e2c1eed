"""A tier short of room under a shared budget waits a bounded time for a busy tier instead of giving up.

A layout flooded by writers holds its locks most of the time; the budget full of its unpinned blocks must
still give room to another layout's put (host) and write-behind (LMDB). Every wait has a deadline: a tier
busy for longer leaves the write refused, reported as not stored. Two tiers reclaiming from each other
while holding their own locks never wait for each other (one waits, the other tries once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.layout import KVLayout
from kvstore.tiers.host.tier import HostTier
from kvstore.tiers.lmdb.env import block_budget
from kvstore.tiers.lmdb.tier import DiskTier
from kvstore.tiers.shared_capacity import SharedCapacity

A = KVLayout(2, 2, 64, 16, "float32", "a")  # 32 KiB blocks
B = KVLayout(2, 2, 64, 16, "float32", "b")
LIMIT = 1 << 20  # 32 blocks of either
BUSY_S = 0.3
"""How long a flood's step holds the other layout's lock in these tests: well under the wait."""


def _blocks(layout: KVLayout, n: int, seed: int) -> list[torch.Tensor]:
    return [torch.full((layout.bytes_per_block,), (seed + i) % 251, dtype=torch.uint8) for i in range(n)]


def _keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i % 256]) * 16 for i in range(n)]


def _busy(lock: threading.Lock | threading.RLock, seconds: float) -> threading.Thread:
    """Hold ``lock`` on another thread for ``seconds`` (a flooding writer's step); returns once it is held."""
    held = threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            time.sleep(seconds)

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(5)
    return thread


@pytest.fixture
def hosts() -> Iterator[tuple[SharedCapacity, HostTier, HostTier]]:
    cap = SharedCapacity(LIMIT)
    a = HostTier(A, LIMIT, shared_memory=False, shared_capacity=cap, label="test-a")
    b = HostTier(B, LIMIT, shared_memory=False, shared_capacity=cap, label="test-b")
    assert all(a.put(_keys(1, 32), _blocks(A, 32, 0)))  # the whole budget, every block unpinned
    yield cap, a, b
    for t in (a, b):
        t.check_integrity()
        t.close()


def test_a_put_waits_for_the_busy_layout_holding_the_host_budget(hosts: tuple[SharedCapacity, HostTier, HostTier]) -> None:
    cap, a, b = hosts
    a.last_use = b.last_use = time.monotonic()  # the flooded layout is no idler than this one
    busy = _busy(a._lock, BUSY_S)  # noqa: SLF001 - the flooded tier in the middle of a step
    t0 = time.monotonic()
    assert all(b.put(_keys(2, 4), _blocks(B, 4, 0)))
    assert BUSY_S * 0.5 < time.monotonic() - t0 < BUSY_S + 0.5  # it waited for the step to end, no longer
    busy.join()
    assert sum(a.contains(k) for k in _keys(1, 32)) == 28 and cap.used == LIMIT


def test_a_put_waits_for_the_busy_owner_of_the_other_layout(hosts: tuple[SharedCapacity, HostTier, HostTier]) -> None:
    cap, a, b = hosts
    a.shed_guard = threading.Lock()  # a daemon's backend mutex, held between its steps
    a.last_use = b.last_use = time.monotonic()
    busy = _busy(a.shed_guard, BUSY_S)
    assert all(b.put(_keys(2, 4), _blocks(B, 4, 0)))
    busy.join()
    assert cap.used == LIMIT


def test_a_layout_busy_past_the_deadline_leaves_the_put_refused_not_hung(
        hosts: tuple[SharedCapacity, HostTier, HostTier]) -> None:
    cap, a, b = hosts
    cap.wait_s = 0.2
    a.last_use = b.last_use = time.monotonic()
    busy = _busy(a._lock, 2.0)  # noqa: SLF001 - a tier that stays busy (a stuck writer)
    t0 = time.monotonic()
    assert b.put(_keys(2, 4), _blocks(B, 4, 0)) == [False] * 4
    assert 0.15 < time.monotonic() - t0 < 1.5
    busy.join()
    assert all(a.contains(k) for k in _keys(1, 32))


def test_a_pinned_block_is_never_taken_however_long_the_put_waits(
        hosts: tuple[SharedCapacity, HostTier, HostTier]) -> None:
    cap, a, b = hosts
    cap.wait_s = 0.2
    a.pin(_keys(1, 32))  # being read, or acknowledged and waiting for its disk write
    assert b.put(_keys(2, 4), _blocks(B, 4, 0)) == [False] * 4
    assert all(a.contains(k) for k in _keys(1, 32))
    a.unpin(_keys(1, 32))


def test_the_disk_write_of_a_quiet_layout_waits_for_the_busy_one_that_fills_the_disk(tmp_path: Path) -> None:
    cap = SharedCapacity(block_budget(4 << 20))
    a = DiskTier(A, tmp_path / "a", 4 << 20, shared_capacity=cap, map_step=1 << 20)
    b = DiskTier(B, tmp_path / "b", 4 << 20, shared_capacity=cap, map_step=1 << 20)
    try:
        ka = _keys(1, 200)
        for i in range(0, len(ka), 20):  # more than the budget: the disk full of the busy layout's blocks
            assert all(a.put(ka[i : i + 20], _blocks(A, 20, i)))
        assert a.used_bytes() > cap.limit * 0.8
        a.last_use = b.last_use = time.monotonic()  # the flooded layout is no idler than this one
        busy = _busy(a._write_lock, BUSY_S)  # noqa: SLF001 - the flooded tier committing a batch
        kb = _keys(2, 20)
        assert all(b.put(kb, _blocks(B, 20, 0)))  # a write-behind batch of acknowledged blocks: all stored
        busy.join()
        assert a.used_bytes() + b.used_bytes() <= cap.limit
        out = [torch.empty(B.bytes_per_block, dtype=torch.uint8) for _ in kb]
        assert all(b.get(kb, out)) and all(torch.equal(o, x) for o, x in zip(out, _blocks(B, 20, 0)))
    finally:
        a.close()
        b.close()


class _Fake:
    """A tier whose writer holds ``lock`` while it reclaims (as host and LMDB tiers do); every byte sheddable."""

    def __init__(self, used: int) -> None:
        self.lock = threading.Lock()
        self.used = used
        self.last_use = 0.0

    def shed(self, nbytes: int, wait_s: float = 0.0) -> int:
        if not self.lock.acquire(timeout=wait_s):
            return 0
        try:
            freed = min(nbytes, self.used)
            self.used -= freed
            return freed
        finally:
            self.lock.release()

    def used_bytes(self) -> int:
        return self.used


def test_two_tiers_reclaiming_from_each_other_never_wait_for_each_other() -> None:
    cap = SharedCapacity(100, wait_s=3.0)
    x, y = _Fake(50), _Fake(50)
    cap.join(x)
    cap.join(y)
    both_hold = threading.Barrier(2)
    lacking: dict[str, int] = {}

    def writer(name: str, me: _Fake) -> None:
        with me.lock:  # its own lock held, as a put holds its tier's
            both_hold.wait()
            lacking[name] = cap.reclaim_waiting(lambda: max(0, 10 - (cap.limit - cap.others_used(me) - me.used)), me)

    threads = [threading.Thread(target=writer, args=(n, t)) for n, t in (("x", x), ("y", y))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert time.monotonic() - t0 < 1.5  # neither waited out its deadline
    assert sorted(lacking.values()) == [0, 10]  # one tried once and was refused; the other then had its room
