"""Large arena copies are split over two threads (the host tier's and the daemon clients' copies): each half
goes to its own thread, every slot is copied exactly once, and small copies stay on the caller's thread."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvstore.layout import KVLayout
from kvstore.tiers.host.arena import PARALLEL_COPY_BYTES, copy_split
from kvstore.tiers.host.tier import HostTier


def test_a_large_copy_is_split_in_halves_and_a_small_one_is_not() -> None:
    seen: list[tuple[str, list[int], list[int]]] = []
    lock = threading.Lock()

    def copy(slots: Sequence[int], addrs: Sequence[int]) -> None:
        with lock:
            seen.append((threading.current_thread().name, list(slots), list(addrs)))

    with ThreadPoolExecutor(1, thread_name_prefix="copier") as pool:
        bpb = PARALLEL_COPY_BYTES // 4
        copy_split(copy, [0, 1, 2, 3, 4], [10, 11, 12, 13, 14], bpb, lambda: pool)
        assert sorted((s, a) for _, s, a in seen) == [([0, 1], [10, 11]), ([2, 3, 4], [12, 13, 14])]
        assert {n.startswith("copier") for n, _, _ in seen} == {True, False}  # one half each
        seen.clear()
        copy_split(copy, [0, 1, 2], [10, 11, 12], bpb, lambda: pool)  # 3/4 of the threshold
        assert [(s, a) for _, s, a in seen] == [([0, 1, 2], [10, 11, 12])]
        assert not seen[0][0].startswith("copier")


def test_host_tier_batches_above_the_threshold_round_trip_bit_identical() -> None:
    layout = KVLayout(model_id="big", num_layers=4, num_kv_heads=8, head_dim=128, block_size=64, dtype="float16")
    n = PARALLEL_COPY_BYTES // layout.bytes_per_block * 2 + 1  # an odd count, over the threshold
    tier = HostTier(layout, n * layout.bytes_per_block)
    gen = torch.Generator().manual_seed(3)
    blocks = [torch.randint(0, 256, (layout.bytes_per_block,), dtype=torch.uint8, generator=gen) for _ in range(n)]
    keys = [i.to_bytes(32, "big") for i in range(n)]
    assert tier.put(keys, blocks) == [True] * n
    dests = [torch.zeros(layout.bytes_per_block, dtype=torch.uint8) for _ in range(n)]
    assert tier.get(keys, dests) == [True] * n
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
    tier.close()
