"""A tier that lives in a ``kvstore serve`` daemon: the daemon's host (shm) tier in front of its disk tier.

The engine's :class:`~kvstore.store.tiered.TieredStore` uses it as its one lower
tier (``TieredStore(layout, pool, host=None, disk=DaemonTier(client))``); the
radix index and GPU pool stay in the engine process.

Data path for a local client (Unix socket, shared memory)::

    get:  keys the slot directory lists: copy slot → dest, proven whole by the slot's seqlock
          (kvstore.tiers.host.slot_directory), no request; the reads are reported later (TOUCH_QUIET, no
          reply, with the next request or after QUIET_DELAY_S). The rest (on disk only, or a slot
          reused during the copy):
          GET_SHM (daemon locks slots) ─► copy slot → dest ─► release deferred: inside the next
          GET_SHM (GET_SHM_RELEASE), or a RELEASE_QUIET (no reply) with any other request or after
          QUIET_DELAY_S
    put:  PUT_SHM_RESERVE (daemon reserves slots) ─► copy src → slot ─► PUT_SHM_COMMIT

and for a remote one (TCP) the bytes travel inline (GET_INLINE, PUT_INLINE).
Each exchange holds the client's lock, so it sees one connection. A slot is
used only while its hold is younger than half the daemon's hold timeout;
an older one counts as a miss (get) or is aborted (put), so a slot the
daemon may have reclaimed is never read or written.

When the daemon is unreachable the tier degrades instead of failing the
engine: probes find nothing, gets miss, puts are not stored; it reconnects
with backoff on a later call.

Deadlines (the ``deadlines:`` section): a probe answers within
``lookup_ms`` or finds nothing; a get within ``load_floor_ms`` plus
``load_slack`` times its bytes at the bandwidth measured on earlier gets, or
misses (the engine recomputes); a put within ``save_ms``, or is not stored.
After ``breaker_failures`` misses in a row the client's breaker opens and
every call is a fast miss until the daemon answers a background probe, so a
paused daemon costs the engine a few deadlines, not the pause.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dataclasses import dataclass

from kvstore.util.breaker import MissReason
from kvstore.tiers.codec import as_u8
from kvstore.config.deadlines import DeadlinesConfig
from kvstore.config.schema import KVStoreConfig
from kvstore.daemon.wire import messages as m
from kvstore.daemon.client.connection import DaemonClient, DaemonUnavailable
from kvstore.daemon.wire.frames import MAX_KEYS, Op
from kvstore.errors import TierError
from kvstore.hashing import KEY_BYTES
from kvstore.layout import KVLayout
from kvstore.store.load_clock import LoadClock
from kvstore.util.ratelog import RateLimitedLog
from kvstore.tiers.base import Buffer, Located, Tier, TierStats, buffer_addresses
from kvstore.tiers.host.arena import SlotCopy, copy_split

log = logging.getLogger(__name__)
PUT_RETRIES = 4
PUT_RETRY_S = 0.002
"""First pause before retrying blocks the daemon had no free slot for (doubling per retry)."""
THROUGH = "daemon:"
"""How a block found through the daemon is named: this, then the daemon's tier holding it (``daemon:disk``)."""


@dataclass(frozen=True)
class PutOutcome:
    """What a put did: ``stored[i]``, the daemon holds ``keys[i]`` now; ``reason``, why some were not stored."""

    stored: list[bool]
    reason: MissReason | None = None


class DaemonTier(Tier):
    """Blocks kept by the daemon the ``client`` talks to."""

    name = "daemon"
    shared = True  # every engine on the host reads it
    reports_evictions = False  # the daemon evicts on its own and sends no events: ask it at lookup
    probes_by_chain = True  # its remote tier (if any) places blocks by chain position
    max_put_blocks = None  # a put goes in requests of at most a quarter of the daemon's slots (_batch)
    served_as = tuple(THROUGH + t for t in m.FOUND_TIERS)  # a hit is named by the daemon tier holding it

    def __init__(self, layout: KVLayout, client: DaemonClient, deadlines: DeadlinesConfig | None = None) -> None:
        super().__init__(layout)
        self.client = client
        self.deadlines = deadlines or DeadlinesConfig()
        self.bpb = layout.bytes_per_block
        self._copier: ThreadPoolExecutor | None = None
        """Copies half of a large batch (as the embedded host tier does), started at the first one."""
        self.misses: dict[tuple[str, str], int] = {}
        """Calls that gave nothing, by (``lookup``/``load``/``save``, :class:`MissReason` value)."""
        self.blocks_missed: dict[tuple[str, str], int] = {}
        """Blocks not loaded or not saved, by the same."""
        self._miss_lock = threading.Lock()
        self._ratelog = RateLimitedLog(log)
        self.clock = LoadClock(self.deadlines)
        """The deadline of a get, from the bandwidth of earlier ones."""
        self._salt_known: tuple[bytes | None] | None = (client.hello.salt,) if client.hello is not None else None

    @classmethod
    def from_config(cls, cfg: KVStoreConfig, client_name: str = "", wait_s: float = 10.0,
                    layout: KVLayout | None = None) -> DaemonTier:
        """Connect to the daemon at ``cfg.daemon.socket_path`` for ``layout`` (default: ``cfg.model``'s), with
        ``cfg.deadlines``' breaker, waiting up to ``wait_s`` for it to answer. Raises like
        :meth:`DaemonClient.connect`."""
        layout = layout if layout is not None else cfg.model.layout()
        dl = cfg.deadlines
        client = DaemonClient(layout, socket_path=os.fspath(cfg.daemon.socket_path), token=cfg.daemon.token,
                              client_name=client_name or f"engine pid {os.getpid()}", prefault=cfg.host.prefault,
                              breaker=dl.breaker(), probe_timeout_s=dl.probe_ms / 1000)
        client.connect(wait_s)
        return cls(layout, client, dl)

    def load_deadline_s(self, nbytes: int) -> float:
        """Seconds a get of ``nbytes`` may take (:meth:`~kvstore.store.load_clock.LoadClock.deadline_s`)."""
        return self.clock.deadline_s(nbytes)

    def health(self) -> dict[str, object]:
        """The breaker's snapshot (state, transitions), the misses by operation and reason (calls and blocks),
        the measured load bandwidth and the request/reply exchanges made so far (:attr:`DaemonClient.round_trips`)."""
        out: dict[str, object] = dict(self.client.breaker.snapshot()) if self.client.breaker is not None else {
            "endpoint": self.client.address, "state": "none"}
        with self._miss_lock:
            out["misses"] = [{"op": op, "reason": r, "calls": n, "blocks": self.blocks_missed.get((op, r), 0)}
                             for (op, r), n in sorted(self.misses.items())]
        out["load_bandwidth_bytes_per_s"] = round(self.clock.bandwidth)
        out["load_latency_s"] = self.clock.latency
        out["measured_loads"] = self.clock.measured
        out["round_trips"] = self.client.round_trips
        return out

    def count_miss(self, op: str, reason: MissReason, blocks: int = 0) -> None:
        """Count one call of ``op`` that gave nothing (or not all) for ``reason``, ``blocks`` of it."""
        with self._miss_lock:
            self.misses[(op, reason.value)] = self.misses.get((op, reason.value), 0) + 1
            self.blocks_missed[(op, reason.value)] = self.blocks_missed.get((op, reason.value), 0) + blocks

    @property
    def salt(self) -> bytes | None:
        """The tenant salt the daemon assigned at the latest handshake (``None``: no tenant salt).

        Known without a request once connected (keys are made with it on the engine's thread, which must not
        wait on a daemon that stopped answering): the salt is the daemon's for this client's token, the same
        at every login."""
        hello = self.client.hello
        if hello is None and self._salt_known is None:
            try:
                with self.client.within(self.deadlines.lookup_ms / 1000):
                    hello = self.client.ensure()
            except DaemonUnavailable as exc:
                raise DaemonUnavailable(f"the tenant salt is not known yet: {exc}") from None
        if hello is not None:
            self._salt_known = (hello.salt,)
        assert self._salt_known is not None
        return self._salt_known[0]

    # ------------------------------------------------------------- queries
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the daemon holds (0 while it is unreachable). Changes nothing."""
        return sum(n for _, n in self.locate_prefix(keys))

    def probe(self, chain: Sequence[bytes], start: int = 0) -> int:
        """How many blocks of ``chain`` (its keys from position 0), from position 0, the daemon can serve, given
        the caller holds the first ``start`` (``start`` while it is unreachable). Unlike :meth:`contains_prefix`
        this reaches the daemon's remote tier, whose groups are placed by chain position; the daemon starts
        loading the blocks it counts there, so a :meth:`get` of them finds them."""
        return start + sum(n for _, n in self.locate_chain(chain, start))

    def locate_prefix(self, keys: Sequence[bytes]) -> Located:
        """:meth:`contains_prefix`, by the daemon tier holding each run (``daemon:host``, ``daemon:disk``), in the
        same round trip. Changes nothing."""
        try:
            with self.client.within(self.deadlines.lookup_ms / 1000):
                runs = self.client.locate_prefix(keys)
        except DaemonUnavailable as exc:
            self._log_miss("lookup", exc)
            return ()
        return tuple((THROUGH + tier, n) for tier, n in runs)

    def locate_chain(self, chain: Sequence[bytes], start: int = 0) -> Located:
        """:meth:`probe`, past ``start``, by the daemon tier holding each run (``daemon:remote`` too), in the same
        round trip."""
        try:
            with self.client.within(self.deadlines.lookup_ms / 1000):
                runs = self.client.locate_chain(chain, start)
        except DaemonUnavailable as exc:
            self._log_miss("lookup", exc)
            return ()
        return tuple((THROUGH + tier, n) for tier, n in runs)

    def _log_miss(self, op: str, exc: DaemonUnavailable, blocks: int = 0) -> None:
        """Count the miss; one log line per miss, except while the breaker is open (its own line says so once)."""
        self.count_miss(op, exc.reason, blocks)
        if exc.reason == MissReason.BREAKER_OPEN:
            log.debug("daemon tier %s: %s", op, exc)
        else:
            self._ratelog.warning(f"{op}:{exc.reason.value}", "kvstore %s missed (%s): %s", op, exc.reason.value, exc)

    def contains(self, key: bytes) -> bool:
        """Whether the daemon holds ``key``. Changes nothing."""
        return self.contains_prefix([key]) == 1

    # ---------------------------------------------------------------- data
    def get(self, keys: Sequence[bytes], dests: Sequence[Buffer], deadline_s: float | None = None) -> list[bool]:
        """Copy found blocks into ``dests``; the daemon marks them recently used (and loads disk hits into its host tier).

        A key named twice is asked for once (the daemon refuses repeats) and copied to its other places. The get
        gives up after :meth:`load_deadline_s` of its bytes, or ``deadline_s`` if sooner (the caller's own bound:
        when recomputing would be done)."""
        first = _first_places(keys)
        if len(first) < len(keys):
            places = list(first.values())
            got = dict(zip(first, self.get([keys[i] for i in places], [dests[i] for i in places], deadline_s)))
            for i, key in enumerate(keys):
                if got[key] and first[key] != i:
                    as_u8(dests[i])[:] = as_u8(dests[first[key]])
            return [got[k] for k in keys]
        addrs = buffer_addresses(keys, dests, self.bpb, "daemon")
        out: list[bool] = []
        t0 = time.monotonic()
        try:
            budget = self.load_deadline_s(len(keys) * self.bpb)
            with self.client.within(budget if deadline_s is None else min(budget, deadline_s)):
                step = self._batch()
                for start in range(0, len(keys), step):
                    ks, ds = list(keys[start : start + step]), list(dests[start : start + step])
                    out += self._get_batch(ks, ds, addrs[start : start + step])
            self.clock.record(sum(out) * self.bpb, time.monotonic() - t0)
        except DaemonUnavailable as exc:
            self._log_miss("load", exc, len(keys) - len(out))
            if exc.reason == MissReason.DEADLINE:  # given up at the deadline: the daemon is at most this fast now
                self.clock.record_missed(len(keys) * self.bpb, time.monotonic() - t0)
            out += [False] * (len(keys) - len(out))
        hits = sum(out)
        self._stats.hits += hits
        self._stats.misses += len(out) - hits
        self._stats.bytes_read += hits * self.bpb
        return out

    def put(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        """Hand blocks to the daemon; ``result[i]`` says whether it holds ``keys[i]`` afterwards (a key named
        twice is sent once, with its first block)."""
        return self.put_outcome(keys, srcs).stored

    def put_outcome(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> PutOutcome:
        """:meth:`put`, and why blocks were not stored: ``no_room`` (the daemon answered without keeping them),
        ``deadline``, ``breaker_open`` or ``daemon_gone``. The whole put gives up after ``save_ms``."""
        first = _first_places(keys)
        if len(first) < len(keys):
            places = list(first.values())
            inner = self.put_outcome([keys[i] for i in places], [srcs[i] for i in places])
            stored = dict(zip(first, inner.stored))
            return PutOutcome([stored[k] for k in keys], inner.reason)
        addrs = buffer_addresses(keys, srcs, self.bpb, "daemon")
        out: list[bool] = []
        reason: MissReason | None = None
        try:
            with self.client.within(self.deadlines.save_ms / 1000):
                step = self._batch()
                for start in range(0, len(keys), step):
                    ks, ss = list(keys[start : start + step]), list(srcs[start : start + step])
                    out += self._put_retrying(ks, ss, addrs[start : start + step])
        except DaemonUnavailable as exc:
            self._log_miss("save", exc, len(keys) - len(out))
            reason = exc.reason
            out += [False] * (len(keys) - len(out))
        if reason is None and not all(out):
            reason = MissReason.NO_ROOM
            self.count_miss("save", reason, len(out) - sum(out))
        self._stats.puts += sum(out)
        self._stats.bytes_written += sum(out) * self.bpb
        return PutOutcome(out, reason)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Ask the daemon to remove ``keys`` from its tiers; returns how many it removed."""
        n = 0
        self.client.ensure()
        step = self.client.max_keys
        for start in range(0, len(keys), step):
            n += m.decode_count(self.client.keys_request(Op.DELETE, keys[start : start + step]), Op.DELETE)
        return n

    def flush(self) -> None:
        """Make every put the daemon acknowledged durable on its disk; raises :class:`TierError` if unreachable
        and :class:`~kvstore.errors.NotDurable` when acknowledged blocks did not reach its disk."""
        try:
            self.client.flush()
        except DaemonUnavailable as exc:
            raise TierError(f"flush of the daemon tier failed: {exc}") from None

    def close(self) -> None:
        """Flush (when the daemon answers), then disconnect; the daemon's data stays (that is the point of it).

        Raises :class:`~kvstore.errors.NotDurable` (after disconnecting) when the final flush reports lost blocks.
        """
        try:
            if self.client.breaker is not None and self.client.breaker.is_open:
                log.warning("daemon tier close: not flushed: the daemon at %s missed its deadlines (breaker open); "
                            "what it acknowledged is written by its own write-behind", self.client.address)
            else:
                self.client.flush()
        except DaemonUnavailable as exc:
            log.warning("daemon tier close: could not flush: %s", exc)
        finally:
            self.client.close()
            if self._copier is not None:
                self._copier.shutdown(wait=True)
                self._copier = None

    def stats(self) -> TierStats:
        """This process's view (hits, misses, bytes) plus the daemon's occupancy when it answers (within
        ``probe_ms``)."""
        snap = super().stats()
        try:
            with self.client.within(self.deadlines.probe_ms / 1000):
                remote = self.client.stats()
        except DaemonUnavailable:
            return snap
        for tier in ("host", "disk"):
            t = remote.get(tier)
            if isinstance(t, dict):
                snap.used_bytes += int(t.get("used_bytes", 0))
                snap.capacity_bytes += int(t.get("capacity_bytes", 0))
                snap.evictions += int(t.get("evictions", 0))
                snap.corrupt_dropped += int(t.get("corrupt_dropped", 0))
        disk = remote.get("disk")
        host = remote.get("host")
        counts: dict[str, Any] = disk if isinstance(disk, dict) else host if isinstance(host, dict) else {}
        snap.num_blocks = int(counts.get("num_blocks", 0))
        return snap

    # ------------------------------------------------------------- private
    def _batch(self) -> int:
        """Keys per request (raises :class:`DaemonUnavailable` when not connected and no daemon answers): at most a quarter of the daemon's slots (a batch pins its slots until committed or
        released, and committed ones until written to disk), and for inline bytes what fits one frame."""
        hello = self.client.hello if self.client.hello is not None else self.client.ensure()  # raises unreachable
        n = max(1, min(hello.max_keys, hello.num_slots // 4))
        return min(n, self._inline_batch()) if hello.shm_name is None else n

    def _inline_batch(self) -> int:
        """Keys per PUT_INLINE: as many blocks as fit one frame, at most the daemon's ``max_keys``."""
        hello = self.client.hello if self.client.hello is not None else self.client.ensure()
        return max(1, min(hello.max_keys, (hello.max_frame_bytes - 64) // (self.bpb + KEY_BYTES + 1)))

    def _fresh(self, since: float) -> bool:
        hello = self.client.hello
        return hello is not None and time.monotonic() - since < hello.hold_timeout_s / 2

    def _get_batch(self, keys: list[bytes], dests: list[Buffer], addrs: list[int]) -> list[bool]:
        """One GET (``addrs``: the ``dests``' addresses, from :func:`buffer_addresses`)."""
        c = self.client
        with c.locked():
            c.ensure()
            t0 = time.monotonic()
            if c.arena is None:
                blocks = m.decode_blocks(c.keys_request(Op.GET_INLINE, keys), self.bpb)
                for block, dest in zip(blocks, dests):
                    if block is not None:
                        dest.numpy()[:] = memoryview(block)
                return [b is not None for b in blocks]
            direct = self._get_direct(keys, addrs) if c.directory is not None else None
            if direct is not None:
                if all(direct):
                    return direct
                rest = [i for i, ok in enumerate(direct) if not ok]
                for i, ok in zip(rest, self._get_held([keys[i] for i in rest], [addrs[i] for i in rest], t0)):
                    direct[i] = ok
                return direct
            return self._get_held(keys, addrs, t0)

    def _get_direct(self, keys: list[bytes], addrs: list[int]) -> list[bool] | None:
        """Copy the keys the slot directory lists straight out of the arena, with no request (client lock held);
        ``True`` where the copy is proven whole (see :mod:`kvstore.tiers.host.slot_directory`), and those reads are
        reported to the daemon with the next request (TOUCH_QUIET). ``None``: the directory lists none of them."""
        c = self.client
        assert c.directory is not None and c.arena is not None
        ticket = c.directory.begin(keys)
        if not ticket.index:
            return None
        index = ticket.index
        self._copy(c.arena.read_slots, ticket.slots, [addrs[i] for i in index])
        out = [False] * len(keys)
        for i, ok in zip(index, c.directory.confirm(ticket)):
            out[i] = ok  # False: the slot was reused during the copy; the daemon is asked for it
        try:
            c.defer_touch([keys[i] for i in index if out[i]])
        except DaemonUnavailable:
            pass  # the reads are whole; only the daemon's count of them is lost
        return out

    def _get_held(self, keys: list[bytes], addrs: list[int], t0: float) -> list[bool]:
        """GET_SHM (the daemon holds the slots), copy, deferred release (client lock held)."""
        c = self.client
        slots = m.decode_slots(c.get_shm(keys), Op.GET_SHM)
        arena = c.arena
        if arena is None:
            raise DaemonUnavailable("the daemon did not offer shared memory for GET_SHM")
        found = [slot for _, slot in slots]
        hit = [(slot, addr) for slot, addr in zip(found, addrs) if slot is not None]
        self._copy(arena.read_slots, [s for s, _ in hit], [a for _, a in hit])
        fresh = self._fresh(t0)
        held = [k for k, s in zip(keys, found) if s is not None]
        if held:
            try:
                c.defer_release(held)  # rides in the next request's frame or send
            except DaemonUnavailable:
                pass  # the daemon ends the holds at their deadline
        return [s is not None and fresh for s in found]

    def _copy(self, copy: SlotCopy, slots: list[int], addrs: list[int]) -> None:
        """``copy(slots, addrs)`` (an arena read or write), split over two threads when large, like the embedded
        host tier (:func:`copy_split`); the copier thread starts on the first large copy."""
        copy_split(copy, slots, addrs, self.bpb, self._copy_thread)

    def _copy_thread(self) -> ThreadPoolExecutor:
        if self._copier is None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-daemon-tier-copy")
        return self._copier

    def _put_retrying(self, keys: list[bytes], srcs: list[Buffer], addrs: list[int]) -> list[bool]:
        """:meth:`_put_batch`, retrying keys refused for lack of room while the daemon's writer frees slots; keys
        still refused because no host slot could be freed (every slot held by readers or writers) are sent inline,
        which the daemon writes straight to its disk tier: a full host tier is a slower put, not a refused one (an
        engine told "not stored" keeps no lower copy of that prefix)."""
        ok, no_room = self._put_batch(keys, srcs, addrs)
        for attempt in range(PUT_RETRIES):
            todo = [i for i, f in enumerate(ok) if not f]
            if not todo:
                break
            time.sleep(PUT_RETRY_S * 2**attempt)
            got, full = self._put_batch([keys[i] for i in todo], [srcs[i] for i in todo], [addrs[i] for i in todo])
            for i, f, r in zip(todo, got, full):
                ok[i], no_room[i] = f, r
        through = [i for i, (f, r) in enumerate(zip(ok, no_room)) if not f and r]
        step = self._inline_batch()
        for start in range(0, len(through), step):
            part = through[start : start + step]
            for i, f in zip(part, self._put_inline([keys[i] for i in part], [srcs[i] for i in part])):
                ok[i] = f
        return ok

    def _put_inline(self, keys: list[bytes], srcs: list[Buffer]) -> list[bool]:
        """One PUT_INLINE: the blocks' bytes in the request (the daemon stores them in host, or on disk when its
        host has no room)."""
        payload = m.encode_put_inline(keys, [s.numpy().data for s in srcs])
        with self.client.locked():
            return m.decode_flags(self.client.request(Op.PUT_INLINE, payload), Op.PUT_INLINE)

    def _put_batch(self, keys: list[bytes], srcs: list[Buffer], addrs: list[int]) -> tuple[list[bool], list[bool]]:
        """One PUT (``addrs``: the ``srcs``' addresses, from :func:`buffer_addresses`): whether each key is stored,
        and whether the daemon refused it for want of a host slot it could free (``NO_ROOM``)."""
        c = self.client
        with c.locked():
            c.ensure()
            t0 = time.monotonic()
            if c.arena is None:
                return self._put_inline(keys, srcs), [False] * len(keys)  # the daemon writes these through itself
            states = m.decode_slots(c.keys_request(Op.PUT_SHM_RESERVE, keys), Op.PUT_SHM_RESERVE)
            no_room = [st == m.PutState.NO_ROOM for st, _ in states]
            arena = c.arena
            mine = [(k, a, slot) for k, a, (st, slot) in zip(keys, addrs, states)
                    if st == m.PutState.RESERVED and slot is not None]  # decode_slots: RESERVED always has a slot
            try:
                if arena is None or not self._fresh(t0):
                    if mine:
                        c.keys_request(Op.RELEASE, [k for k, _, _ in mine])
                    return [st == m.PutState.PRESENT for st, _ in states], no_room
                self._copy(arena.write_slots, [slot for _, _, slot in mine], [a for _, a, _ in mine])
                committed = dict(zip([k for k, _, _ in mine], m.decode_flags(
                    c.keys_request(Op.PUT_SHM_COMMIT, [k for k, _, _ in mine]), Op.PUT_SHM_COMMIT) if mine else []))
            except DaemonUnavailable:  # past the deadline after reserving: give the slots back, not to its expiry
                c.release_now([k for k, _, _ in mine])
                raise
            return [st == m.PutState.PRESENT or committed.get(k, False) for k, (st, _) in zip(keys, states)], no_room



def _first_places(keys: Sequence[bytes]) -> dict[bytes, int]:
    """Each distinct key of ``keys`` with the index of its first mention, in order."""
    first: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    return first
