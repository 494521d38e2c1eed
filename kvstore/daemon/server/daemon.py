"""The daemon: listeners, the hold reaper, stats, and an orderly shutdown.

One file past 500 lines, on purpose: :class:`DaemonServer` owns the daemon's life (start, accept, open a
shelf per layout, stop and drain) and the fields those steps share (the config, the shared capacities, the
dormant layouts, the sessions); each part that stands alone is a module of its own already (``session``,
``shelves``, ``socketfile``, ``http``, ``metrics``, ``admission``).

::

    start ─► clear a stale socket ─► host tier (sealed memfd, passed to local clients) + disk tier
          ─► Unix socket (0600) [+ TCP] [+ HTTP /healthz /metrics] ─► reaper task
    stop  ─► stop accepting ─► wait for requests in flight ─► close connections
          ─► flush (write-behind drained, disk synced) ─► unlink socket, unmap the arena
          (:attr:`DaemonServer.durability_error` says whether acknowledged blocks were lost)

A Unix client's process is identified at accept (:class:`PeerProcess`); when
its connection ends with holds open and the process is gone, they end at once.

Tier work that may wait for disk I/O runs on a thread pool; the event loop
parses frames, keeps the hold table, answers, and runs the requests that
only touch host memory (see ``Session._on_loop`` and
``DaemonBackend.hold_in_host``: an executor hop would cost more than they do).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.config.schema import KVStoreConfig
from kvstore.daemon.server.admission import ConnectionLimits, LoginThrottle, Transport, peer_of
from kvstore.daemon.wire.frames import ErrorCode, Op, encode_frame
from kvstore.daemon.wire.messages import encode_error
from kvstore.daemon.server.http import HttpEndpoints
from kvstore.daemon.server.inflight import InflightBudget
from kvstore.build_info import build_info, installed_version
from kvstore.daemon.server.metrics import DaemonMetrics, render_prometheus
from kvstore.daemon.server.peer import PeerProcess
from kvstore.daemon.wire.layout_check import layout_fields
from kvstore.daemon.server.session import Session, SessionContext
from kvstore.daemon.server.layout_dirs import layout_dirname, layout_label, layout_section, recorded_layouts, write_layout_file
from kvstore.daemon.server.dormant import DormantLayouts
from kvstore.daemon.server.shelves import Shelf, Shelves
from kvstore.daemon.server.socketfile import DaemonStartError, SocketOwner, arena_label, bind_private, clear_stale
from kvstore.daemon.server.tenancy import Tenant, TenantCounters
from kvstore.errors import NotDurable
from kvstore.util.ratelog import RateLimitedLog
from kvstore.layout import KVLayout
from kvstore.tiers.datadir import DirLock, make_private_dir
from kvstore.tiers.shared_capacity import HOST_RECLAIM_WAIT_S, SharedCapacity

if TYPE_CHECKING:  # the storage modules bring torch: imported when the first layout opens (kvstore.tiers)
    from kvstore.daemon.server.backend import DaemonBackend
    from kvstore.daemon.server.events import DaemonEvents
    from kvstore.daemon.server.remote_link import RemoteLink
    from kvstore.route.publisher import EventPublisher
    from kvstore.tiers.chain import ChainTier

log = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 10.0
LOG_INTERVAL_S = 10.0
"""Repeated conditions a peer can cause at will (refusals, errors, accept failures) log once per this."""
FD_HEADROOM = 256
"""File descriptors kept beyond ``max_connections`` for the tiers, the listeners and the executor."""


@dataclass(frozen=True)
class ListenInfo:
    """Where a started daemon listens."""

    socket_path: str
    tcp: str | None
    metrics_url: str | None
    shm_name: str | None
    """The label of the shared arena local clients map; ``None`` when tenants are configured (private memory)."""
    events: str | None = None
    """Where the daemon publishes its KV events (``daemon.events``), or ``None``."""
    events_replay: str | None = None


class DaemonServer:
    """The sidecar daemon for one config. :meth:`start`, then :meth:`wait_stopped` or :meth:`stop`."""

    def __init__(self, cfg: KVStoreConfig, executor_threads: int = 16, config_source: str = "<unknown>") -> None:
        """``config_source`` names the config file in errors sent to clients (a refused layout says where to fix it)."""
        self.cfg = cfg.for_role("daemon")  # unset data paths: the daemon's own defaults
        self.layout: KVLayout | None = self.cfg.model.layout() if self.cfg.daemon.layouts == "model" else None
        """The one layout of ``daemon.layouts: model``; ``None``: every layout clients bring (:mod:`.shelves`)."""
        self.config_source = config_source
        self.metrics = DaemonMetrics()
        self.started_at = time.time()
        self._version = installed_version()  # the kvstore_build_info labels, read at each scrape (torch's once loaded)
        self._executor = ThreadPoolExecutor(executor_threads, thread_name_prefix="kvstore-daemon")
        self._sessions: set[Session] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._servers: list[asyncio.AbstractServer] = []
        self._http: HttpEndpoints | None = None
        self._ids = itertools.count(1)
        d = cfg.daemon
        self._limits = ConnectionLimits(d.max_connections, d.max_connections_per_peer)
        self._throttle = LoginThrottle(d.max_login_failures, d.login_lockout_s)
        self._events = RateLimitedLog(log, LOG_INTERVAL_S)
        self._inflight = InflightBudget(int(d.max_inflight_bytes))
        self._tenant_counters: dict[str, TenantCounters] = {}
        self._stop = asyncio.Event()
        self._stopping = False
        self.shelves: Shelves | None = None
        self._arena_label: str | None = None
        self._capacity: SharedCapacity | None = None
        """The host memory the layouts' arenas share (``layouts: any``)."""
        self._disk_capacity: SharedCapacity | None = None
        """The disk space the layouts' LMDB environments share (``layouts: any`` with an lmdb tier)."""
        self._dir_lock: DirLock | None = None
        """``layouts: any``: the lock on ``disk.path`` itself (each layout's tier locks its own directory)."""
        self._dormant = DormantLayouts(None)
        self._publisher: EventPublisher | None = None
        self.info: ListenInfo | None = None
        self._owner: SocketOwner | None = None
        """The socket path's owner lock, held from :meth:`start` until :meth:`stop` has removed the socket."""
        self.durability_error: str | None = None
        """Set by :meth:`stop` when acknowledged blocks could not be made durable (the exit status says so)."""

    # ------------------------------------------------------------- start
    async def start(self) -> ListenInfo:
        """Open the tiers and every listener; returns where it listens. Raises ``DaemonStartError``/``TierError``."""
        cfg, d = self.cfg, self.cfg.daemon
        self._owner = SocketOwner(d.socket_path)  # before the path is looked at: a live owner's is never touched
        try:
            return await self._start()
        except BaseException:
            self._owner.release()
            raise

    async def _start(self) -> ListenInfo:
        cfg, d = self.cfg, self.cfg.daemon
        named = arena_label(d.socket_path)
        if clear_stale(d.socket_path):
            log.warning("removed a stale socket %s left by a daemon that is gone", d.socket_path)
        # Tenants' blocks never sit where a local process can map them: with tenants the host tier is this
        # process's own memory, and every client (local ones too) is served inline.
        shared = not d.tenant_salts
        self._arena_label = named if shared else None
        if not shared:
            log.warning("tenants are configured (daemon.tenant_salts): the host tier is private memory, not the "
                        "shared arena %s, so no local process can read or change a tenant's blocks; local clients "
                        "are served inline (no zero-copy path)", named)
        if self.layout is None:  # (no events, no file or slab tier: kvstore.config.serve_checks refused them)
            self._capacity = SharedCapacity(int(cfg.host.capacity), wait_s=HOST_RECLAIM_WAIT_S)
            if "lmdb" in cfg.tiers:
                from kvstore.tiers.lmdb.env import block_budget

                self._disk_capacity = SharedCapacity(block_budget(int(cfg.disk.max_size)))
                base = cfg.disk.directory()  # one daemon per directory, as one tier per environment
                make_private_dir(base)
                self._dir_lock = DirLock(base, "disk.path")
        self._dormant = DormantLayouts(self._disk_capacity)
        self.shelves = Shelves(self._open_shelf, self.layout, d.max_layouts, self.config_source, self._executor,
                               max_per_tenant=d.max_layouts_per_tenant, directory_of=self._layout_directory,
                               dormant=self._dormant)
        if self.layout is not None:
            self.shelves.open_pinned()
        elif self._disk_capacity is not None:  # layouts served before: their disk data counts from now on
            found = recorded_layouts(cfg.disk.directory())
            for layout in found:
                directory = self._layout_directory(layout)
                assert directory is not None
                self._dormant.add(layout, directory)
            if found:
                log.info("%d layouts have disk data from before (%d bytes, counted in disk.max_size); each opens when "
                         "its first client comes", len(found), self._dormant.used_bytes())
        asyncio.get_running_loop().set_exception_handler(self._loop_error)
        _raise_fd_limit(d.max_connections + FD_HEADROOM)
        tenants = {token: Tenant.from_salt(salt) for token, salt in d.tenant_salts.items()}
        counters = {t.label: TenantCounters() for t in tenants.values()}
        ctx = SessionContext(d, self.shelves, self.metrics, self._executor, self.stats,
                             self._throttle, self._events, tenants, counters, self._inflight)
        self._tenant_counters = counters
        self._servers.append(await bind_private(
            d.socket_path, lambda p: asyncio.start_unix_server(lambda r, w: self._accept(r, w, "unix", ctx), p)
        ))
        try:
            tcp = None
            if d.tcp_host is not None:
                srv = await asyncio.start_server(lambda r, w: self._accept(r, w, "tcp", ctx), d.tcp_host, d.tcp_port)
                self._servers.append(srv)
                addr = srv.sockets[0].getsockname()
                tcp = f"{addr[0]}:{addr[1]}"
            metrics_url = None
            if cfg.metrics.enabled:
                self._http = HttpEndpoints(lambda: not self._stopping, self._metrics_text)
                try:
                    mhost, mport = await self._http.start(cfg.metrics.host, cfg.metrics.port)
                except OSError as exc:
                    why = os.strerror(exc.errno) if exc.errno else str(exc)
                    raise DaemonStartError(f"metrics.port {cfg.metrics.port}: cannot listen on "
                                           f"{cfg.metrics.host}:{cfg.metrics.port} ({why})") from exc
                metrics_url = f"http://{mhost}:{mport}"
            if self.backend is not None and self.backend.events is not None:
                self._publisher = self._publish_events(self.backend.events)
        except BaseException:
            await self.stop()  # the socket is ours by now: remove it, do not leave it behind
            raise
        self._spawn(self._reap_holds())
        events = self._publisher.endpoint if self._publisher is not None else None
        replay = self._publisher.replay_endpoint if self._publisher is not None else None
        self.info = ListenInfo(os.path.abspath(d.socket_path), tcp, metrics_url, self._arena_label, events, replay)
        where = f"unix {self.info.socket_path} (0600), tcp {tcp or 'off'}, metrics {metrics_url or 'off'}"
        if self.layout is None:
            log.info("kvstore daemon serving any layout (up to %d), each opened on its first client, sharing %d bytes "
                     "of host memory in %s; %s", d.max_layouts, int(cfg.host.capacity),
                     "sealed memfds" if self._arena_label else "private memory (tenants)", where)
            return self.info
        assert self.backend is not None
        host, disk, lay = self.backend.host, self.backend.disk, self.layout
        log.info(
            "kvstore daemon serving model %r (%d layers, block %d tokens, %d bytes/block): host %d slots in %s, "
            "%s; %s", lay.model_id, lay.num_layers, lay.block_size, lay.bytes_per_block, host.num_slots,
            f"sealed memfd {self._arena_label}" if self._arena_label else "private memory (tenants)",
            f"disk {disk.name} at {getattr(disk, 'path', '?')}" if disk else "no disk tier", where,
        )
        return self.info

    @property
    def backend(self) -> DaemonBackend | None:
        """The storage of ``daemon.layouts: model``'s one layout (``None`` before start, or serving any layout)."""
        if self.layout is None or self.shelves is None or not self.shelves.all():
            return None
        return self.shelves.all()[0].backend

    def _open_shelf(self, layout: KVLayout) -> Shelf:
        """Open ``layout``'s storage: its host arena (shared memory unless tenants are configured; under
        ``layouts: any`` sparse, counted against the shared budget), its disk tier (under ``layouts: any`` in a
        directory of its own) and its remote link. Raises ``ValueError`` naming a layout this daemon cannot
        store, ``DaemonStartError``/``TierError`` when a tier cannot open."""
        from kvstore.daemon.server.backend import DaemonBackend
        from kvstore.daemon.server.holds import HoldTable
        from kvstore.lower.build import HostPlan, build_lower_tiers, disk_section, disk_tier_name
        from kvstore.lower.write_policy import WriteRule
        from kvstore.tiers.lmdb.check import check_walkable_databases

        cfg, d = self.cfg, self.cfg.daemon
        capacity = int(cfg.host.capacity)
        if layout.bytes_per_block > capacity:
            raise ValueError(f"one block is larger than host.capacity ({capacity} bytes)")
        least = d.min_frame_bytes(layout)
        if int(d.max_frame_bytes) < least:
            raise ValueError(f"daemon.max_frame_bytes ({int(d.max_frame_bytes)}) is below the {least} bytes a frame "
                             "of one such block needs")
        label = self._arena_label
        if label is not None and self.layout is None:
            label = f"{label}-{layout.fingerprint.hex()[:8]}"
        # Shared capacity: sparse arenas, never pinned (pinning maps every page: each layout would hold it all).
        pin = cfg.host.pin_memory if self._capacity is None else "never"
        most = d.max_layout_slots if self.layout is None else None  # a client chose this layout: bound its cost
        plan = HostPlan(auto_evict=True, always=True, shared_memory=label is not None, label=label or "kvstore-host",
                        pin_memory=pin, shared_capacity=self._capacity, max_slots=most)
        self._dormant.wake(layout)  # its directory's bytes: counted by its own tier from here on
        mine = self._layout_config(layout)
        section = disk_section(mine)
        if disk_tier_name(mine) == "lmdb" and section is not None and os.path.isdir(section.directory()):
            # LMDB aborts the process on some damaged pages: walk them in a child first, refuse with a message
            check_walkable_databases(section.directory())
        # refused if another process holds its data directory
        tiers = build_lower_tiers(mine, layout, plan, disk_capacity=self._disk_capacity)
        host, lower = tiers.host, tiers.disk
        assert host is not None  # plan.always
        if most is not None and host.num_slots == most:
            log.warning("layout %s: %d-byte blocks would make %d host slots; it gets daemon.max_layout_slots = %d "
                        "(%d bytes of host.capacity)", layout_label(layout), layout.bytes_per_block,
                        capacity // layout.bytes_per_block, most, most * layout.bytes_per_block)
        if section is not None and self._disk_capacity is not None:
            write_layout_file(section.directory(), layout)  # whose blocks these are: for kvstore repair --salvage
        durable = lower is not None and ((lower.name == "lmdb" and cfg.disk.sync == "always")
                                         or (lower.name == "slab" and cfg.slab.sync == "always"))
        backend = DaemonBackend(layout, host, lower, HoldTable(d.hold_timeout_s), durable_puts=durable,
                                publish_events=d.events.enabled, write=WriteRule.from_config(mine.policy))
        if tiers.remote is not None:
            try:
                backend.link = self._remote_link(backend, tiers.remote)
            except BaseException:
                tiers.remote.close()
                backend.close()
                raise
        return Shelf(layout, backend, label, self._layout_directory(layout))

    def _layout_directory(self, layout: KVLayout) -> str | None:
        """Where ``layout`` keeps its disk data under ``layouts: any`` (``None``: no disk tier, or one layout)."""
        if self.layout is not None or "lmdb" not in self.cfg.tiers:
            return None
        return layout_section(self.cfg.disk, layout_dirname(layout)).directory()

    def _publish_events(self, events: DaemonEvents) -> EventPublisher:
        """Bind ``daemon.events``' endpoints and publish ``events`` there (raises ``DaemonStartError`` naming
        the field when an endpoint cannot be bound)."""
        from kvstore.route.publisher import default_replica_id, publish_feed  # zmq only when events are on

        cfg = self.cfg.daemon.events
        try:
            assert self.layout is not None  # events need layouts: model (checked at start)
            publisher = publish_feed(cfg, self.layout.block_size, events.drain, events.holdings,
                                     default_id=f"{default_replica_id()}:daemon")
        except OSError as exc:
            raise DaemonStartError(f"daemon.events: {exc}") from exc
        log.info("KV events of the daemon's tiers as replica %s on %s (replay %s)", publisher.replica,
                 publisher.endpoint, publisher.replay_endpoint or "off")
        return publisher

    def _layout_config(self, layout: KVLayout) -> KVStoreConfig:
        """The config ``layout``'s tiers are built from: this daemon's, with the disk tier's directory moved to
        the layout's own under the configured one when ``daemon.layouts: any`` (one LMDB environment per layout)."""
        if self.layout is not None:
            return self.cfg
        name = layout_dirname(layout)
        return self.cfg.model_copy(update={section: layout_section(getattr(self.cfg, section), name)
                                           for section in ("disk", "file", "slab")})

    def _remote_link(self, backend: DaemonBackend, remote: ChainTier) -> RemoteLink:
        """The link that places the clients' blocks in ``remote``'s groups (Redis or Valkey, a server or a
        cluster; connected lazily, so a server down at start is a miss, not an error)."""
        from kvstore.daemon.server.remote_link import link_for

        try:
            link = link_for(backend, remote, self.cfg)
        except ValueError as exc:
            raise DaemonStartError(str(exc)) from None
        assert link is not None
        log.info("remote tier %s: groups of %d blocks, write %s", self.cfg.remote.url.split("@")[-1],
                 remote.group_blocks, self.cfg.remote.write)
        return link

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, transport: Transport,
                      ctx: SessionContext) -> None:
        if self._stopping:
            writer.close()
            return
        peer = peer_of(writer, transport)
        why = self._limits.admit(peer)
        if why is None and transport == "tcp" and self._throttle.locked_for(peer):
            self._limits.leave(peer)
            why = f"too many failed logins from {peer.ident}; refused for another {self._throttle.locked_for(peer):.0f} s"
        if why is not None:  # refused at once: one small error frame, never a read
            self._events.warning(f"refused:{transport}", "refused a %s connection from %s: %s", transport, peer.ident, why)
            self.metrics.error(ErrorCode.UNAVAILABLE.name)
            writer.write(encode_frame(Op.ERROR, 0, encode_error(ErrorCode.UNAVAILABLE, f"connection refused: {why}")))
            writer.close()
            return
        session = Session(next(self._ids), peer, ctx)
        process = PeerProcess.of_peer(peer.pid)
        self._sessions.add(session)
        try:
            await session.serve(reader, writer)
        finally:
            self._sessions.discard(session)
            self._limits.leave(peer)
            shelf = session.shelf
            if shelf is not None and not self._stopping:
                shelf.backend.end_connection(session.conn_id)  # its reads end now, its writes are quarantined
                assert self.shelves is not None
                self.shelves.leave(shelf, session.tenant.label if session.tenant is not None else None)
            if process is not None and shelf is not None:
                self._spawn(self._release_when_gone(shelf.backend, session.conn_id, process))
            elif process is not None:
                process.close()

    async def _release_when_gone(self, backend: DaemonBackend, owner: int, process: PeerProcess) -> None:
        """After ``owner``'s connection ended: if it still has holds, end them as soon as its process exits
        (a live but silent process keeps them until their deadline, and the slots of its expired write holds
        stay quarantined until it exits or ``QUARANTINE_FACTOR`` deadlines have passed)."""
        from kvstore.daemon.server.client_slots import QUARANTINE_FACTOR

        wait_s = QUARANTINE_FACTOR * self.cfg.daemon.hold_timeout_s
        try:
            if backend.owned_by(owner) and await process.wait_gone(wait_s) \
                    and not self._stopping:  # stopping: the tiers are being closed, holds die with them
                loop = asyncio.get_running_loop()
                n = await loop.run_in_executor(self._executor, backend.release_owner, owner)
                if n:
                    log.info("client %d (pid %d) exited: released its %d host slot holds", owner, process.pid, n)
        finally:
            process.close()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Event-loop errors (an ``accept`` failing with EMFILE repeats every second): once per interval."""
        exc = context.get("exception")
        message = str(context.get("message", "event loop error"))
        topic = f"loop:{message}:{type(exc).__name__}"
        self._events.error(topic, "event loop: %s: %s", message, exc if exc is not None else "")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reap_holds(self) -> None:
        period = min(1.0, self.cfg.daemon.hold_timeout_s / 4)
        loop = asyncio.get_running_loop()
        assert self.shelves is not None
        while not self._stopping:
            await asyncio.sleep(period)
            n = 0
            for shelf in self.shelves.all():
                if not shelf.closed:
                    n += await loop.run_in_executor(self._executor, shelf.backend.expire)
            if n:
                log.warning("released %d host slot holds past their %.1f s deadline", n, self.cfg.daemon.hold_timeout_s)

    # ------------------------------------------------------------- stats
    async def stats(self) -> dict[str, Any]:
        """Storage snapshot plus daemon facts (clients, requests, where it listens, uptime).

        ``layouts``: one entry per layout served, by label, with its layout's fields and its own snapshot. At
        the top level, the storage snapshot of ``daemon.layouts: model``'s layout, or, serving any layout,
        every layout's figures summed (:func:`sum_snapshots`; absent before the first layout is opened).
        """
        assert self.shelves is not None
        loop = asyncio.get_running_loop()
        snaps = [(shelf, await loop.run_in_executor(self._executor, shelf.backend.stats)) for shelf in self.shelves.all()]
        out = dict(snaps[0][1]) if self.layout is not None else sum_snapshots([snap for _, snap in snaps])
        if self._capacity is not None and out.get("host"):
            out["host"]["capacity_bytes"] = self._capacity.limit  # the arenas share it: not one each
        if self._disk_capacity is not None and out.get("disk"):
            out["disk"]["capacity_bytes"] = self._disk_capacity.limit
        out["layouts"] = {shelf.label: {"layout": layout_fields(shelf.layout),
                                        "bytes_per_block": shelf.layout.bytes_per_block, **snap}
                          for shelf, snap in snaps}
        out["daemon"] = {
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "clients": self.metrics.clients,
            "connections": self.metrics.connections,
            "connections_refused": self._limits.refused,
            "inflight": {"bytes": self._inflight.used, "limit": self._inflight.limit,
                         "waited": self._inflight.waited, "refused": self._inflight.refused},
            "tenants": {label: c.as_dict() for label, c in self._tenant_counters.items()},
            "requests": dict(self.metrics.requests),
            "errors": dict(self.metrics.errors),
            "socket_path": self.info.socket_path if self.info else None,
            "tcp": self.info.tcp if self.info else None,
            "metrics_url": self.info.metrics_url if self.info else None,
            "layouts": self.cfg.daemon.layouts,
            "max_layouts": self.shelves.max_layouts,
            "layouts_closed": self.shelves.closed_idle,
            "layouts_dormant": len(self._dormant),
            "dormant_disk_bytes": self._dormant.used_bytes(),
            "model_id": self.layout.model_id if self.layout is not None else None,
            "bytes_per_block": self.layout.bytes_per_block if self.layout is not None else None,
            "host_capacity_shared": (None if self._capacity is None else
                                     {"used_bytes": self._capacity.used, "limit_bytes": self._capacity.limit}),
        }
        pub = self._publisher
        ev = self.backend.events if self.backend is not None else None
        out["events"] = None if pub is None or ev is None else {
            "replica": pub.replica, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
            "last_seq": pub.last_seq, "replays_served": pub.replays_served, "reports_served": pub.reports_served,
            "reports_built": pub.reports_built,
            "queued": len(ev.queue), "dropped": ev.queue.dropped,
        }
        return out

    async def _metrics_text(self) -> str:
        assert self.shelves is not None
        loop = asyncio.get_running_loop()
        snaps = [(shelf, await loop.run_in_executor(self._executor, shelf.backend.stats)) for shelf in self.shelves.all()]
        if self.layout is not None:
            return render_prometheus(self.metrics, snaps[0][1], build_info(self._version))
        return render_prometheus(self.metrics, [({"layout": shelf.label}, snap) for shelf, snap in snaps], build_info(self._version))

    # -------------------------------------------------------------- stop
    def request_stop(self) -> None:
        """Ask :meth:`wait_stopped` to shut down (safe from a signal handler on the loop)."""
        self._stop.set()

    async def wait_stopped(self) -> None:
        """Wait for :meth:`request_stop`, then shut down."""
        await self._stop.wait()
        await self.stop()

    async def stop(self) -> None:
        """Stop accepting, let requests in flight finish, flush, remove the socket and the shared memory."""
        if self._stopping:
            return
        self._stopping = True
        log.info("stopping: no new connections; %d open", len(self._sessions))
        for srv in self._servers:
            srv.close()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while any(s.busy for s in self._sessions) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for s in list(self._sessions):
            if s.writer is not None:
                s.writer.close()
        for task in list(self._tasks):
            task.cancel()
        if self._http is not None:
            await self._http.close()
        try:
            os.unlink(self.cfg.daemon.socket_path)
        except FileNotFoundError:
            pass
        loop = asyncio.get_running_loop()
        if self._publisher is not None:  # before the tiers close: its last drain reads their queues
            await loop.run_in_executor(self._executor, self._publisher.close)
        for shelf in self.shelves.all() if self.shelves is not None else []:
            try:
                await loop.run_in_executor(self._executor, shelf.backend.flush)
                log.info("flushed%s: every acknowledged block is on disk", "" if self.layout else f" {shelf.label}")
            except NotDurable as exc:
                self.durability_error = f"{exc}; they are lost with this process"
                log.error("shutdown flush of %s: %s", shelf.label, self.durability_error)
            try:
                await loop.run_in_executor(self._executor, shelf.backend.close)
            except Exception as exc:  # noqa: BLE001 - the exit status reports it; the socket and shm are gone
                self.durability_error = self.durability_error or f"closing the disk tier failed: {type(exc).__name__}: {exc}"
                log.error("closing the tiers of %s failed: %s", shelf.label, exc)
        self._executor.shutdown(wait=True)
        if self._dir_lock is not None:
            self._dir_lock.release()
        if self._owner is not None:
            self._owner.release()  # last: the socket is gone, a new daemon may take the path
        log.info("stopped")


def sum_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Several layouts' storage snapshots as one: numbers summed, flags or'ed, nested sections summed alike
    (``None`` where no layout has the section), other values from the first that has them."""
    out: dict[str, Any] = {}
    for snap in snapshots:
        for key, value in snap.items():
            have = out.get(key)
            if value is None:
                out.setdefault(key, None)
            elif have is None:
                out[key] = sum_snapshots([value]) if isinstance(value, dict) else value
            elif isinstance(value, bool):
                out[key] = have or value
            elif isinstance(value, (int, float)) and isinstance(have, (int, float)):
                out[key] = have + value
            elif isinstance(value, dict) and isinstance(have, dict):
                out[key] = sum_snapshots([have, value])
    return out


def _raise_fd_limit(wanted: int) -> None:
    """Raise the soft open-files limit toward ``wanted`` (at most the hard limit); warn when it stays short,
    since accepted connections past it fail with EMFILE before the connection caps can refuse them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning("open-files limit %d is below daemon.max_connections + %d = %d: lower max_connections or raise "
                    "the limit (ulimit -n)", soft, FD_HEADROOM, wanted)
