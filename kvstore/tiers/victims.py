"""The victim hook of a tier that evicts on its own (LMDB, file, slab), and the sends it handed back.

::

    put needs room ─► victims chosen ─► offer(victims, read)      hook reads what it needs, returns a send
                   ─► deletion committed ─► committed(send)
                   ─► write lock released ─► run_ready()            the send runs (it only schedules work)

A send whose deletion failed (an aborted LMDB transaction) is never passed to :meth:`Handover.committed`,
so nothing is handed on for blocks that stayed. Failures of the hook or of a send are logged and never
fail the eviction: a tier's capacity must hold whatever its owner does with the victims.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvstore.tiers.base import BlockReader, VictimHook, VictimSend

log = logging.getLogger(__name__)


class Handover:
    """One tier's victim hook (``None``: none set) and the sends of committed evictions not yet run."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.hook: VictimHook | None = None
        self._ready: list[VictimSend] = []
        self._lock = threading.Lock()

    def offer(self, keys: Sequence[bytes], read: BlockReader) -> VictimSend | None:
        """Show the hook the victims ``keys`` (still readable through ``read``); its send, or ``None``."""
        hook = self.hook
        if hook is None or not keys:
            return None
        try:
            return hook(keys, read)
        except Exception:  # noqa: BLE001 - the eviction must proceed; the hook's owner loses an optimisation
            log.exception("the %s tier's victim hook failed on %d victims", self.tier, len(keys))
            return None

    def committed(self, send: VictimSend | None) -> None:
        """The victims ``send`` was made for are gone: queue it for :meth:`run_ready`."""
        if send is not None:
            with self._lock:
                self._ready.append(send)

    def run_ready(self) -> None:
        """Run the queued sends (call without the tier's write lock)."""
        with self._lock:
            ready, self._ready = self._ready, []
        for send in ready:
            try:
                send()
            except Exception:  # noqa: BLE001 - as in offer
                log.exception("a send of the %s tier's victim hook failed", self.tier)
