"""An engine's saves never wait on kvstore: the step only queues them; a full queue drops a save, counted and
logged with the real reason; a store that refuses them is logged as such (not as "no room" when it is gone)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from connectors.engine_store import EngineBlockStore
from connectors.save_queue import SaveQueue
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float16", model_id="save-queue-test")


class StuckTier:
    """A tier whose puts wait for ``gate`` (a daemon that stopped answering), then store or refuse."""

    name = "stuck"

    def __init__(self, store: bool = True) -> None:
        self.gate = threading.Event()
        self.store = store
        self.stored: list[bytes] = []

    def put(self, keys: Sequence[bytes], srcs: Sequence[Any]) -> list[bool]:
        assert self.gate.wait(20)
        if self.store:
            self.stored += list(keys)
        return [self.store] * len(keys)


def blocks(n: int) -> torch.Tensor:
    return torch.zeros((n, LAYOUT.bytes_per_block), dtype=torch.uint8)


def keys(n: int, tag: int) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def test_a_stuck_store_never_holds_the_step_and_a_full_queue_drops_the_save(caplog: pytest.LogCaptureFixture) -> None:
    tier = StuckTier()
    q = SaveQueue(EngineBlockStore(LAYOUT, [tier]), max_bytes=6 * LAYOUT.bytes_per_block)  # type: ignore[list-item]
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="connectors.save_queue"):
        assert q.submit(keys(2, 1), blocks(2))  # taken by the writer, which is stuck in the tier
        time.sleep(0.05)
        assert q.submit(keys(4, 2), blocks(4))  # waits in the queue (6 blocks held: the bound)
        assert not q.submit(keys(1, 3), blocks(1))  # full: dropped at once
    assert time.monotonic() - t0 < 1.0
    assert q.stats()["dropped"] == {"queue_full": 1}
    assert any("queue_full" in r.getMessage() and "deadlines.save_queue" in r.getMessage() for r in caplog.records)
    tier.gate.set()
    assert q.wait_idle(10)
    assert tier.stored == keys(2, 1) + keys(4, 2) and q.stats()["saved_blocks"] == 6
    q.close()


def test_a_refused_save_is_logged_as_no_room_with_the_count(caplog: pytest.LogCaptureFixture) -> None:
    tier = StuckTier(store=False)
    tier.gate.set()
    q = SaveQueue(EngineBlockStore(LAYOUT, [tier]), max_bytes=1 << 20)  # type: ignore[list-item]
    with caplog.at_level(logging.WARNING, logger="connectors.save_queue"):
        q.submit(keys(3, 4), blocks(3))
        assert q.wait_idle(10)
    assert q.stats()["dropped"] == {"no_room": 3}
    assert any("dropped 3 saved blocks (no_room)" in r.getMessage() for r in caplog.records)
    q.close()
