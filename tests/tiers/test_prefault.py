"""Host arena pages mapped ahead (kvstore.tiers.host.prefault): the daemon's segment allocated, a client's view
mapped with no faults left for its copies, a kernel that refuses, and a stop between chunks."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource
import threading

import pytest
import torch
from tiers_testlib import LAYOUTS

from kvstore.tiers.host import prefault as prefault_module
from kvstore.tiers.host.arena import HostArena
from kvstore.tiers.host.tier import HostTier
from kvstore.tiers.host.prefault import MADV_POPULATE_WRITE, Prefaulter

L = LAYOUTS["float16"]
PAGE = os.sysconf("SC_PAGE_SIZE")
ARENA = 8 << 20


def _allocated(arena: HostArena) -> int:
    """Bytes the kernel has allocated to the shared arena (its owner's memfd)."""
    assert arena.fd is not None
    return os.fstat(arena.fd).st_blocks * 512


def _populate(p: Prefaulter | None) -> None:
    assert p is not None
    assert p.done.wait(30) and p.error == "" and p.populated == p.nbytes


def test_the_owner_allocates_its_segment_ahead_and_a_client_maps_its_view_ahead() -> None:
    owner = HostArena.allocate(ARENA // 4096, 4096, pin=False, shared=True)
    assert owner.name is not None
    assert _allocated(owner) < ARENA // 4  # a new arena has (almost) no pages yet
    _populate(owner.prefault("test owner"))
    assert _allocated(owner) >= ARENA
    assert owner.prefault("again") is None  # one prefaulter per arena

    def faults_writing(arena: HostArena) -> int:
        assert arena.tensor is not None
        src = torch.full((arena.tensor.numel(),), 7, dtype=torch.uint8)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        arena.tensor.copy_(src)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    assert owner.fd is not None
    plain = HostArena.attach(os.dup(owner.fd), owner.name, 4096)
    ahead = HostArena.attach(os.dup(owner.fd), owner.name, 4096)
    assert faults_writing(plain) >= ARENA // PAGE // 2  # every page of a fresh view traps once
    _populate(ahead.prefault("test client"))
    assert faults_writing(ahead) < ARENA // PAGE // 8
    assert ahead.tensor is not None and int(ahead.tensor[12345]) == 7  # populating changed no byte
    for arena in (plain, ahead, owner):
        arena.close()


def test_host_tier_prefaults_unless_told_not_to() -> None:
    on = HostTier(L, 64 * L.bytes_per_block, pin_memory="never")
    off = HostTier(L, 64 * L.bytes_per_block, pin_memory="never", prefault=False)
    assert on.arena._prefaulter is not None and off.arena._prefaulter is None
    _populate(on.arena._prefaulter)
    on.close()
    off.close()
    assert on.arena._prefaulter is None  # stopped and dropped before the memory went


def test_a_kernel_without_populate_write_is_logged_and_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[tuple[int, int, int]] = []

    def refuse(address: int, length: int, advice: int) -> int:
        calls.append((address, length, advice))
        ctypes.set_errno(errno.EINVAL)
        return -1

    with caplog.at_level(logging.INFO, logger="kvstore.tiers.host.prefault"):
        p = Prefaulter(1 << 20, ARENA, "old kernel", madvise=refuse)
        assert p.done.wait(10)
    assert len(calls) == 1 and calls[0][2] == MADV_POPULATE_WRITE  # no retry per chunk
    assert p.populated == 0 and "MADV_POPULATE_WRITE" in p.error and os.strerror(errno.EINVAL) in p.error
    assert "old kernel: pages not mapped ahead" in caplog.text and "Linux 5.14+" in caplog.text


def test_chunks_cover_the_range_and_stop_ends_it_between_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefault_module, "CHUNK_BYTES", 4 * PAGE)
    calls: list[tuple[int, int]] = []
    p = Prefaulter(10 * PAGE + 100, 9 * PAGE, "range", madvise=lambda a, n, _: calls.append((a, n)) or 0)
    _populate(p)
    assert calls == [(10 * PAGE, 4 * PAGE), (14 * PAGE, 4 * PAGE), (18 * PAGE, PAGE + 100)]  # from the page start

    entered, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def slow(address: int, length: int, advice: int) -> int:
        seen.append(address)
        entered.set()
        release.wait(10)
        return 0

    p = Prefaulter(0, 40 * PAGE, "stopped", madvise=slow)
    assert entered.wait(10)
    stopper = threading.Thread(target=p.stop)
    stopper.start()
    while not p._stop.is_set():
        pass
    release.set()
    stopper.join(10)
    assert not stopper.is_alive() and p.done.is_set()
    assert seen == [0] and p.populated == 4 * PAGE  # the chunk in progress finished, no later one began
