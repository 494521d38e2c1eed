"""A store whose lower tier is a live daemon (sidecar mode) writes blocks down in batches: committing or evicting
N blocks costs the same few request/reply exchanges whatever N is (a reserve and a commit per put batch of the
tier, counted by the client and by the daemon), and takes the hierarchy lock the same number of times."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from daemonlib import LAYOUT, Daemon, block_for, cleanup, empty_blocks, short_tmpdir, start_daemon, write_config
from kvstore.config.schema import PolicyConfig
from kvstore.daemon.client.tier import DaemonTier
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.hashing import block_keys
from kvstore.store.tiered import TieredStore

SLOTS = 1024
"""The daemon's host slots: its put batch (a quarter of them) is larger than any commit below."""
SIZES = (4, 64)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root, host={"capacity": SLOTS * LAYOUT.bytes_per_block}))
        yield d
    finally:
        cleanup(d, root)


class CountingLock:
    """The hierarchy's lock, counting how often it is taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.taken = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        self.taken += got
        return got

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> CountingLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _store(tier: DaemonTier, write: str) -> tuple[TieredStore, CountingLock]:
    store = TieredStore(LAYOUT, GPUBlockPool(LAYOUT, 2 * max(SIZES), device="cpu"), None, tier,
                        PolicyConfig(write=write))  # type: ignore[arg-type]
    lock = CountingLock()
    store.h.lock = lock  # type: ignore[assignment]  # before any thread uses it
    return store, lock


def _fill(store: TieredStore, n: int, seed: int) -> tuple[list[bytes], list[int], list[int]]:
    """``n`` new GPU blocks of a chain from fresh tokens, each holding its key's bytes: keys, blocks, tokens."""
    tokens = [seed * 100_000 + i for i in range(n * LAYOUT.block_size)]
    keys = block_keys(tokens, LAYOUT)
    blocks = store.allocate(n)
    for k, b in zip(keys, blocks):
        store.pool.block_bytes(b).copy_(block_for(k))
    return keys, blocks, tokens


def _put_requests(tier: DaemonTier) -> int:
    return int(tier.client.stats()["daemon"]["requests"].get("PUT_SHM_RESERVE", 0))


def _assert_in_daemon(tier: DaemonTier, keys: list[bytes]) -> None:
    dests = empty_blocks(len(keys))
    assert tier.get(keys, dests) == [True] * len(keys)
    assert all(bool((d == block_for(k)).all()) for k, d in zip(keys, dests))


def test_write_through_of_n_blocks_costs_a_reserve_and_a_commit_per_tier_batch(daemon: Daemon) -> None:
    tier = daemon.tier()
    store, lock = _store(tier, "write_through")
    try:
        batch = tier._batch()
        assert batch >= max(SIZES)  # so one batch per commit below
        for seed, n in enumerate(SIZES):
            keys, blocks, tokens = _fill(store, n, seed)
            puts, trips, taken = _put_requests(tier), tier.client.round_trips, lock.taken
            assert store.commit(keys, blocks, tokens) == n
            store.spiller.wait()
            assert tier.client.round_trips - trips == 2 * math.ceil(n / batch), f"{n} blocks written through"
            # the commit, the write-down's references, then its batch: plan, and record and let go
            assert lock.taken - taken == 4, f"hierarchy lock taken per write-through of {n} blocks"
            assert _put_requests(tier) - puts == math.ceil(n / batch)  # the daemon saw as many PUT_SHM_RESERVE
            assert tier.health()["round_trips"] == tier.client.round_trips
            with store.lock:
                assert all(store.index.get(k).on_disk for k in keys)  # type: ignore[union-attr]
            _assert_in_daemon(tier, keys)
            store.free(blocks)
        store.check_integrity()
    finally:
        store.close()


def test_evicting_n_gpu_blocks_to_the_daemon_costs_a_reserve_and_a_commit_per_tier_batch(daemon: Daemon) -> None:
    tier = daemon.tier()
    # A store writes a shared tier (a daemon) through under every policy; this one is made private so nothing is
    # written at commit and the eviction copies every block down, as it does for blocks whose write-through the
    # daemon refused (busy, no room) and for any tier below the GPU that is not shared.
    tier.shared = False
    store, _ = _store(tier, "write_back")
    try:
        batch = tier._batch()
        for seed, n in enumerate(SIZES, start=len(SIZES)):
            keys, blocks, tokens = _fill(store, n, seed)
            assert store.commit(keys, blocks, tokens) == n
            store.free(blocks)
            puts, trips = _put_requests(tier), tier.client.round_trips
            assert store.offload("gpu") == n
            assert tier.client.round_trips - trips == 2 * math.ceil(n / batch), f"{n} blocks evicted"
            assert _put_requests(tier) - puts == math.ceil(n / batch)
            with store.lock:
                assert all((e := store.index.get(k)) is not None and e.on_disk and e.gpu_block is None for k in keys)
            _assert_in_daemon(tier, keys)
        store.check_integrity()
    finally:
        store.close()
