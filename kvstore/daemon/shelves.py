"""The KV layouts a daemon serves, each on a shelf of its own: its host arena, disk tier, remote link.

A block's bytes depend on its model's layout (layers, heads, head size, block size, dtype), so one layout's
blocks can never stand in for another's; keys already carry the layout's fingerprint. A daemon with
``daemon.layouts: model`` serves the ``model`` section's layout alone, opened at start, and refuses an engine
on another model naming each field that differs. With ``layouts: any`` it serves every layout its clients
bring: a client's HELLO carries its layout, and the first client of a layout opens that layout's shelf
(:meth:`Shelves.for_client`), up to ``daemon.max_layouts``. The shelves share the host memory budget
(:mod:`kvstore.tiers.shared_capacity`); each keeps its disk data in a directory named after its layout,
so a restarted daemon finds it again when that layout's first client comes back.

Shelves are opened on the event loop (a HELLO is answered once its shelf exists) and never closed before the
daemon stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.daemon.backend import DaemonBackend
from kvstore.daemon.frames import OBSERVER_FINGERPRINT, ErrorCode, ProtocolError
from kvstore.daemon.layout_check import bad_layout_message
from kvstore.daemon.layout_dirs import layout_label
from kvstore.errors import KVStoreError
from kvstore.layout import KVLayout

log = logging.getLogger(__name__)


@dataclass
class Shelf:
    """One layout's storage in the daemon."""

    layout: KVLayout
    backend: DaemonBackend
    shm_name: str | None
    """The label of this layout's shared arena (``None``: private memory, as with tenants)."""

    @property
    def label(self) -> str:
        """How logs, STATS and ``/metrics`` name the layout: its model id and the start of its fingerprint."""
        return layout_label(self.layout)


class Shelves:
    """The daemon's shelves by layout fingerprint. ``pinned``: the one layout of ``layouts: model``."""

    def __init__(self, open_shelf: Callable[[KVLayout], Shelf], pinned: KVLayout | None, max_layouts: int,
                 config_source: str) -> None:
        self._open = open_shelf
        self.pinned = pinned
        self.max_layouts = max_layouts if pinned is None else 1
        self.config_source = config_source
        self._by_fingerprint: dict[bytes, Shelf] = {}

    def open_pinned(self) -> Shelf:
        """Open the ``model`` section's shelf at start (errors propagate: the daemon does not start)."""
        assert self.pinned is not None
        shelf = self._open(self.pinned)
        self._by_fingerprint[self.pinned.fingerprint] = shelf
        return shelf

    def reopen(self, layouts: list[KVLayout]) -> None:
        """Open the shelves of layouts this daemon served before (their disk data found at start), so their
        blocks count against the shared disk capacity from the start and are served to their first client
        without waiting. One that cannot be opened (damaged) is logged and left to refuse its client, naming
        why; beyond ``max_layouts``, the rest stay closed (logged)."""
        for layout in layouts:
            if len(self._by_fingerprint) >= self.max_layouts:
                log.warning("layout %s has disk data but is not reopened: daemon.max_layouts = %d are open; its "
                            "directory is not counted in the disk capacity until its first client comes",
                            layout_label(layout), self.max_layouts)
                continue
            try:
                self._by_fingerprint[layout.fingerprint] = self._open(layout)
            except (KVStoreError, ValueError, OSError) as exc:
                log.error("layout %s: its disk tier cannot be reopened, its clients are refused: %s",
                          layout_label(layout), exc)
                continue
            log.info("reopened layout %s from its disk data", layout_label(layout))

    def all(self) -> list[Shelf]:
        """Every open shelf, in the order they were opened."""
        return list(self._by_fingerprint.values())

    def for_client(self, fingerprint: bytes, layout: KVLayout | None) -> Shelf | None:
        """The shelf of a logging-in client's layout, opening it on first use; ``None`` for an observer.

        Raises :class:`ProtocolError` (``BAD_LAYOUT``, fatal) naming why the layout cannot be served: another
        layout than a pinned daemon's (each differing field), no layout in the HELLO, too many layouts, or
        tiers that cannot be opened for it (a block larger than the host budget, a disk that refuses).
        """
        if fingerprint == OBSERVER_FINGERPRINT:
            return None
        shelf = self._by_fingerprint.get(fingerprint)
        if shelf is not None:
            return shelf
        if self.pinned is not None:
            raise ProtocolError(ErrorCode.BAD_LAYOUT,
                                bad_layout_message(fingerprint, self.pinned, self.config_source), fatal=True)
        if layout is None:
            raise ProtocolError(ErrorCode.BAD_LAYOUT, "HELLO: the layout is missing; a daemon serving any layout "
                                "opens a layout's tiers from the fields its first client sends", fatal=True)
        if len(self._by_fingerprint) >= self.max_layouts:
            served = ", ".join(s.label for s in self._by_fingerprint.values())
            raise ProtocolError(ErrorCode.BAD_LAYOUT, f"HELLO: layout {layout_label(layout)} would be this daemon's "
                                f"layout {len(self._by_fingerprint) + 1}; it serves at most daemon.max_layouts = "
                                f"{self.max_layouts} ({served}) in {self.config_source}", fatal=True)
        try:
            shelf = self._open(layout)
        except (KVStoreError, ValueError, OSError) as exc:
            raise ProtocolError(ErrorCode.BAD_LAYOUT, f"HELLO: cannot store layout {layout_label(layout)} "
                                f"({layout.bytes_per_block} bytes per block): {exc}", fatal=True) from None
        self._by_fingerprint[fingerprint] = shelf
        log.info("serving a new layout %s: %d layers, %d KV heads, head size %d, block %d tokens, %s, "
                 "%d bytes per block (%d of %d layouts)", shelf.label, layout.num_layers, layout.num_kv_heads,
                 layout.head_dim, layout.block_size, layout.dtype, layout.bytes_per_block,
                 len(self._by_fingerprint), self.max_layouts)
        return shelf
