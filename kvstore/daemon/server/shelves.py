"""The KV layouts a daemon serves, each on a shelf of its own: its host arena, disk tier, remote link.

A block's bytes depend on its model's layout (layers, heads, head size, block size, dtype), so one layout's
blocks can never stand in for another's; keys already carry the layout's fingerprint. A daemon with
``daemon.layouts: model`` serves the ``model`` section's layout alone, opened at start, and refuses an engine
on another model naming each field that differs. With ``layouts: any`` it serves every layout its clients
bring: a client's HELLO carries its layout, and the first client of a layout opens that layout's shelf
(:meth:`Shelves.for_client`). The shelves share the host memory budget
(:mod:`kvstore.tiers.shared_capacity`); each keeps its disk data in a directory named after its layout,
so a restarted daemon finds it again when that layout's first client comes back.

Any client may bring a layout, so what layouts take is bounded and given back:

- a shelf opens on the daemon's executor, never the event loop (opening an LMDB environment walks it for
  damage: seconds for a big one), and clients of one layout arriving together wait for one open;
- ``daemon.max_layouts`` counts the shelves open (and opening); a layout beyond it takes the place of the
  least recently used shelf with no client (flushed and closed; its disk data stays, counted in
  ``disk.max_size`` and the first to give way, :mod:`kvstore.daemon.server.dormant`, and it reopens on demand), and is refused, naming the layouts served, only when every shelf has a client;
- a tenant (``daemon.tenant_salts``) has clients on at most ``daemon.max_layouts_per_tenant`` layouts;
- a shelf whose last client leaves with nothing stored is closed and its directory removed (a login that
  stores nothing leaves nothing behind, not even for the next start);
- a layout whose disk data is damaged is refused with the same message, without walking its files again,
  until they change (``kvstore repair`` moves them aside).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.daemon.wire.frames import OBSERVER_FINGERPRINT, ErrorCode, ProtocolError
from kvstore.daemon.wire.layout_check import bad_layout_message
from kvstore.daemon.server.layout_dirs import layout_label
from kvstore.errors import DamagedData, KVStoreError, NotDurable
from kvstore.layout import KVLayout

if TYPE_CHECKING:  # the storage brings torch: imported when the first layout opens (kvstore.tiers)
    from kvstore.daemon.server.backend import DaemonBackend
    from kvstore.daemon.server.dormant import DormantLayouts

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Shelf:
    """One layout's storage in the daemon."""

    layout: KVLayout
    backend: DaemonBackend
    shm_name: str | None
    """The label of this layout's shared arena (``None``: private memory, as with tenants)."""
    directory: str | None = None
    """The layout's own disk directory under ``layouts: any`` (removed when the shelf closes empty), else ``None``."""
    clients: int = 0
    """Connections logged in with this layout now."""
    tenants: dict[str, int] = field(default_factory=dict)
    """Tenant label -> its connections among :attr:`clients`."""
    last_use: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` of the latest login or logout: the least recent idle shelf makes room first."""
    closed: bool = False

    @property
    def label(self) -> str:
        """How logs, STATS and ``/metrics`` name the layout (:func:`~kvstore.daemon.server.layout_dirs.layout_label`)."""
        return layout_label(self.layout)


@dataclass(frozen=True)
class _Refusal:
    """A layout whose disk data was found damaged, and the state of that data then."""

    message: str
    files: tuple[tuple[str, int, int, int], ...]


class Shelves:
    """The daemon's shelves by layout fingerprint. ``pinned``: the one layout of ``layouts: model``."""

    def __init__(self, open_shelf: Callable[[KVLayout], Shelf], pinned: KVLayout | None, max_layouts: int,
                 config_source: str, executor: Executor, max_per_tenant: int | None = None,
                 directory_of: Callable[[KVLayout], str | None] = lambda layout: None,
                 dormant: DormantLayouts | None = None) -> None:
        """``open_shelf`` opens a layout's tiers (it blocks: it runs on ``executor``); ``directory_of``: where
        a layout keeps its disk data (whose damage is remembered until it changes); ``dormant``: where a shelf
        closed with disk data leaves its directory, counted against the disk budget."""
        self._open = open_shelf
        self.pinned = pinned
        self.max_layouts = max_layouts if pinned is None else 1
        self.max_per_tenant = max_per_tenant
        self.config_source = config_source
        self._executor = executor
        self._directory_of = directory_of
        self._dormant = dormant
        self._by_fingerprint: dict[bytes, Shelf] = {}
        self._opening: dict[bytes, asyncio.Future[Shelf]] = {}
        self._refused: dict[bytes, _Refusal] = {}
        self._closing: dict[bytes, asyncio.Future[None]] = {}
        """Shelves being closed: the same layout opens again only once its directory is free."""
        self.closed_idle = 0
        """Shelves closed because their last client left with nothing stored, or to make room (a counter)."""

    def open_pinned(self) -> Shelf:
        """Open the ``model`` section's shelf at start (errors propagate: the daemon does not start)."""
        assert self.pinned is not None
        shelf = self._open(self.pinned)
        self._by_fingerprint[self.pinned.fingerprint] = shelf
        return shelf

    def all(self) -> list[Shelf]:
        """Every open shelf, in the order they were opened."""
        return list(self._by_fingerprint.values())

    async def for_client(self, fingerprint: bytes, layout: KVLayout | None, tenant: str | None = None) -> Shelf | None:
        """The shelf of a logging-in client's layout, opening it on first use (on the executor), counting the
        client on it; ``None`` for an observer. Each shelf returned must be given back with :meth:`leave`.

        Raises :class:`ProtocolError` (``BAD_LAYOUT``, fatal) naming why the layout cannot be served: another
        layout than a pinned daemon's (each differing field), no layout in the HELLO, every one of
        ``max_layouts`` shelves in use, the tenant's ``max_layouts_per_tenant`` reached, or tiers that cannot
        be opened for it (a block larger than the host budget, a damaged or busy disk directory).
        """
        if fingerprint == OBSERVER_FINGERPRINT:
            return None
        shelf = self._by_fingerprint.get(fingerprint)
        if shelf is None and self.pinned is not None:
            raise ProtocolError(ErrorCode.BAD_LAYOUT,
                                bad_layout_message(fingerprint, self.pinned, self.config_source), fatal=True)
        if shelf is None and layout is None:
            raise ProtocolError(ErrorCode.BAD_LAYOUT, "HELLO: the layout is missing; a daemon serving any layout "
                                "opens a layout's tiers from the fields its first client sends", fatal=True)
        if tenant is not None and self.max_per_tenant is not None and (shelf is None or tenant not in shelf.tenants):
            held = [s.label for s in self._by_fingerprint.values() if tenant in s.tenants]
            if len(held) >= self.max_per_tenant:
                raise ProtocolError(ErrorCode.BAD_LAYOUT, f"HELLO: tenant {tenant} has clients on {len(held)} layouts "
                                    f"({', '.join(held)}), daemon.max_layouts_per_tenant = {self.max_per_tenant} in "
                                    f"{self.config_source}; close those clients first", fatal=True)
        if shelf is None:
            assert layout is not None
            shelf = await self._opened(fingerprint, layout)
        shelf.clients += 1
        if tenant is not None:
            shelf.tenants[tenant] = shelf.tenants.get(tenant, 0) + 1
        shelf.last_use = time.monotonic()
        return shelf

    def leave(self, shelf: Shelf, tenant: str | None = None) -> asyncio.Future[None] | None:
        """A client of ``shelf`` logged out. The last one leaving a shelf that stores nothing closes it and
        removes its directory (returned: the close, running on the executor); else ``None``."""
        shelf.clients -= 1
        if tenant is not None:
            left = shelf.tenants.get(tenant, 0) - 1
            if left > 0:
                shelf.tenants[tenant] = left
            else:
                shelf.tenants.pop(tenant, None)
        shelf.last_use = time.monotonic()
        if shelf.clients or shelf.closed or self.pinned is not None or not shelf.backend.empty():
            return None
        return self._retire(shelf, forget=True)

    # ----------------------------------------------------------- private
    async def _opened(self, fingerprint: bytes, layout: KVLayout) -> Shelf:
        """The shelf of a layout not open yet: opened once however many clients ask at the same time."""
        pending = self._opening.get(fingerprint)
        if pending is not None:
            return await asyncio.shield(pending)
        closing = self._closing.get(fingerprint)
        if closing is not None:  # its directory is locked until its close is over
            await asyncio.shield(closing)
            return await self._opened(fingerprint, layout)
        refusal = self._refused.get(fingerprint)
        if refusal is not None and refusal.files == self._files(layout):
            raise ProtocolError(ErrorCode.BAD_LAYOUT, refusal.message, fatal=True)
        self._refused.pop(fingerprint, None)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Shelf] = loop.create_future()
        self._opening[fingerprint] = future  # from here on, this layout's other clients wait for this open
        try:
            await self._make_room(layout)
            shelf = await loop.run_in_executor(self._executor, self._open, layout)
        except ProtocolError as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: nobody else may be waiting
            raise
        except (KVStoreError, ValueError, OSError) as exc:
            error = ProtocolError(ErrorCode.BAD_LAYOUT, _cannot_store(layout, exc), fatal=True)
            self._remember(layout, exc)
            future.set_exception(error)
            future.exception()
            raise error from None
        finally:
            self._opening.pop(fingerprint, None)
        self._by_fingerprint[fingerprint] = shelf
        future.set_result(shelf)
        log.info("serving a new layout %s: %d layers, %d KV heads, head size %d, block %d tokens, %s, "
                 "%d bytes per block, %d host slots (%d of %d layouts)", shelf.label, layout.num_layers,
                 layout.num_kv_heads, layout.head_dim, layout.block_size, layout.dtype, layout.bytes_per_block,
                 shelf.backend.host.num_slots, len(self._by_fingerprint), self.max_layouts)
        return shelf

    async def _make_room(self, layout: KVLayout) -> None:
        """Below ``max_layouts`` (counting shelves being opened), or close the least recently used shelf with no
        client; raises ``BAD_LAYOUT`` naming the layouts served when every one has a client."""
        while len(self._by_fingerprint) + len(self._opening) > self.max_layouts:  # the asking layout is opening
            idle = [s for s in self._by_fingerprint.values() if not s.clients and s.backend.idle()]
            if not idle:
                served = ", ".join(s.label for s in self._by_fingerprint.values())
                raise ProtocolError(ErrorCode.BAD_LAYOUT, f"HELLO: layout {layout_label(layout)} would be this "
                                    f"daemon's layout {len(self._by_fingerprint) + 1}; it serves at most "
                                    f"daemon.max_layouts = {self.max_layouts} in {self.config_source}, and each of "
                                    f"them has a client now ({served})", fatal=True)
            victim = min(idle, key=lambda s: s.last_use)
            log.info("closing layout %s (no client since %.0f s) to make room for layout %s (daemon.max_layouts = %d); "
                     "its disk data stays and reopens on demand", victim.label, time.monotonic() - victim.last_use,
                     layout_label(layout), self.max_layouts)
            await self._retire(victim, forget=victim.backend.empty())

    def _retire(self, shelf: Shelf, forget: bool) -> asyncio.Future[None]:
        """Take ``shelf`` off the served layouts now and close it on the executor (``forget``: its directory too)."""
        shelf.closed = True
        if self._by_fingerprint.get(shelf.layout.fingerprint) is shelf:
            del self._by_fingerprint[shelf.layout.fingerprint]
        self.closed_idle += 1
        fingerprint = shelf.layout.fingerprint
        done = asyncio.get_running_loop().run_in_executor(self._executor, self._close, shelf, forget)
        self._closing[fingerprint] = done
        done.add_done_callback(lambda _: self._closing.pop(fingerprint, None) if self._closing.get(fingerprint) is done
                               else None)
        return done

    def _close(self, shelf: Shelf, forget: bool) -> None:
        """Flush and close ``shelf``'s tiers; ``forget``: remove its directory too (it stores nothing)."""
        shelf.closed = True
        try:
            shelf.backend.flush()
        except NotDurable as exc:
            log.error("closing layout %s: %s; they are lost", shelf.label, exc)
        try:
            shelf.backend.close()
        except (KVStoreError, OSError) as exc:
            log.error("closing the tiers of layout %s failed: %s", shelf.label, exc)
        if shelf.directory is None:
            return
        if forget:
            shutil.rmtree(shelf.directory, ignore_errors=True)
            log.info("layout %s: no client and no block; closed, directory %s removed", shelf.label, shelf.directory)
        elif self._dormant is not None:
            self._dormant.add(shelf.layout, shelf.directory)

    def _remember(self, layout: KVLayout, exc: BaseException) -> None:
        """Keep the refusal of a layout whose data is damaged, with the state of its files."""
        if isinstance(exc, DamagedData):
            self._refused[layout.fingerprint] = _Refusal(_cannot_store(layout, exc), self._files(layout))

    def _files(self, layout: KVLayout) -> tuple[tuple[str, int, int, int], ...]:
        """Name, inode, size and modification time of each file in the layout's directory (what a repair changes)."""
        directory = self._directory_of(layout)
        if directory is None or not os.path.isdir(directory):
            return ()
        out = []
        for name in sorted(os.listdir(directory)):
            try:
                st = os.stat(os.path.join(directory, name))
            except OSError:
                continue
            out.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)


def _cannot_store(layout: KVLayout, exc: BaseException) -> str:
    """The refusal of a layout whose tiers could not be opened, naming it and why."""
    return f"HELLO: cannot store layout {layout_label(layout)} ({layout.bytes_per_block} bytes per block): {exc}"
