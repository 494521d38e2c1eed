"""Saves off the engine's step: a bounded queue of staged blocks and one background writer.

An engine hands its newly filled blocks to kvstore at the end of a step
(vLLM's ``wait_for_save``). Written there, a slow or paused daemon would
hold the step, and with it every request of the engine. Here the step only
queues blocks it has already copied to host memory; a writer thread sends
them. At most ``max_bytes`` wait: a save that does not fit is dropped and
counted (``queue_full``): kvstore is a cache, so a dropped save is a later
miss, never an error. The writer's own puts give up at the store's save
deadline (``deadlines.save_ms``), so the queue drains even while the daemon
is paused, and its breaker makes those puts instant misses.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence

import torch

from connectors.engine_store import EngineBlockStore
from kvstore.util.breaker import MissReason
from kvstore.util.ratelog import RateLimitedLog

log = logging.getLogger(__name__)


class SaveQueue:
    """Blocks waiting to be stored, written by one background thread (see the module docstring). Thread-safe."""

    def __init__(self, store: EngineBlockStore, max_bytes: int, name: str = "kvstore-save") -> None:
        self.store = store
        self.max_bytes = max_bytes
        self._items: deque[tuple[list[bytes], torch.Tensor]] = deque()
        self._bytes = 0
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self.dropped: dict[str, int] = {}
        """Blocks not stored, by :class:`~kvstore.util.breaker.MissReason` value."""
        self.saved_blocks = 0
        self._ratelog = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[bytes], blocks: torch.Tensor) -> bool:
        """Queue ``blocks`` (``[len(keys), bytes_per_block]`` uint8 in host memory, owned by the queue from now
        on) under ``keys``; returns at once. ``False``: the queue is full and they were dropped (counted)."""
        nbytes = blocks.numel() * blocks.element_size()
        with self._cond:
            if self._bytes + nbytes > self.max_bytes and (self._items or self._busy):
                self._drop(MissReason.QUEUE_FULL, len(keys), f"{self._bytes} bytes of saves are still waiting "
                           f"for the daemon (deadlines.save_queue: {self.max_bytes})")
                return False
            self._items.append((list(keys), blocks))
            self._bytes += nbytes
            self._cond.notify()
        return True

    def _drop(self, reason: MissReason, n: int, why: str) -> None:
        self.dropped[reason.value] = self.dropped.get(reason.value, 0) + n
        self._ratelog.warning(reason.value, "kvstore dropped %d saved blocks (%s): %s; they will be recomputed "
                              "when needed", n, reason.value, why)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                keys, blocks = self._items.popleft()
                self._busy = True
            try:
                outcome = self.store.put_outcome(keys, list(blocks))
            except Exception:  # noqa: BLE001 - a save must never stop the writer
                log.exception("kvstore save of %d blocks failed", len(keys))
                outcome = None
            with self._cond:
                self._bytes -= blocks.numel() * blocks.element_size()
                self._busy = False
                stored = 0 if outcome is None else sum(outcome.stored)
                self.saved_blocks += stored
                if stored < len(keys):
                    reason = outcome.reason if outcome is not None and outcome.reason else MissReason.GONE
                    self._drop(reason, len(keys) - stored, {
                        MissReason.NO_ROOM: "the daemon kept no room for them (its tiers are full of blocks in use)",
                        MissReason.DEADLINE: "the daemon did not take them within deadlines.save_ms",
                        MissReason.BREAKER_OPEN: "the daemon missed its deadlines and is not asked until it answers",
                    }.get(reason, "the daemon is not reachable"))
                self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued save was written (or dropped), at most ``timeout_s``; ``True`` if it was."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._busy, timeout_s)

    def stats(self) -> dict[str, object]:
        """``queued_bytes``, ``saved_blocks`` and ``dropped`` blocks by reason."""
        with self._cond:
            return {"queued_bytes": self._bytes, "saved_blocks": self.saved_blocks, "dropped": dict(self.dropped)}

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (for at most ``timeout_s``), then stop the writer."""
        self.wait_idle(timeout_s)
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()
        self._thread.join(timeout_s)
