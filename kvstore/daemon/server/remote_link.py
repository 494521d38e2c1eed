"""The daemon's remote tier: its clients' chains shared, in groups, with every daemon and engine on the same Redis.

The remote tier stores ``G = remote.group_blocks`` consecutive blocks of a chain as one value, under
the key of the group's last block (:mod:`kvstore.tiers.redis.tier`), exactly as an embedded store does, so
a daemon and an embedded engine on one Redis find each other's prefixes. A group is a span of chain
*positions*, and a client's GET or PUT carries keys only; what places a key in its group is the chain a
lookup sends (EXISTS_CHAIN: every key from position 0, as vLLM's scheduler and the sidecar store have
it). So::

    EXISTS_CHAIN(chain, start)   local prefix (host, then disk) from ``start`` ─► n
                                 the chain's full groups are remembered (member key ─► group keys, bounded)
                                 remote probe from n's group ─► r; the loads of positions [n, r) start now,
                                 into host slots reserved for them, and the reply is r
    GET of a key being loaded    waits for its group (at most remote.timeout_s), then reads host as usual
    a commit completing a group  write_through: the group goes remote on the write policy's thread
    a lookup's local hit         write_through_selective: counted per group; at selective_hits it goes remote
    a disk eviction              write_back: the victim's group is copied in the evicting transaction, then sent

Which groups go remote, and when, is decided by :class:`~kvstore.lower.remote_write.RemoteWritePolicy`, the
one the embedded store uses too; the link gives it the groups its probes remembered and reads their blocks
(:class:`HostGroups`: host slots pinned and copied, disk blocks loaded into host first, or read in the
evicting transaction).

A loaded block is published in the host tier and written behind to disk like a committed one, so the
next lookup on this host is local. Nothing here stalls or fails a client: a dead, slow or paused server
makes the probe a miss after ``remote.probe_timeout_s`` and a load a miss after ``remote.timeout_s``
(the tier's own bounds and back-off); a group store runs on the policy's thread, never a client's.
A key the link forgot (more chains than :data:`GROUP_MEMORY` keys since) is not sent; ``unplaced`` counts them.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvstore.errors import BlockStateError
from kvstore.lower.remote_write import (
    Group,
    RemoteWrite,
    RemoteWritePolicy,
    full_groups,
)
from kvstore.tiers.base import BlockReader, Buffer, Tier, VictimSend
from kvstore.tiers.chain import ChainTier

if TYPE_CHECKING:
    from kvstore.layout import KVLayout
    from kvstore.tiers.host.tier import HostTier

log = logging.getLogger(__name__)

GROUP_MEMORY = 1 << 18
"""Most member keys whose group a link remembers (least recently probed forgotten first): about 50 MB of
bookkeeping for 4M tokens of chains at 16 tokens a block."""
LOAD_WAIT_FACTOR = 2.0
"""A GET waits for a key being loaded at most this many ``remote.timeout_s`` (a load is a few round trips)."""


class LinkBackend(Protocol):
    """What a link uses of the :class:`~kvstore.daemon.server.backend.DaemonBackend` it serves: its tiers and layout, its
    mutex, and its locking, publishing and unpinning of host slots (a loaded block is published like a client's
    put). Declared here so that this module does not import the backend, which holds the link."""

    @property
    def layout(self) -> KVLayout: ...
    @property
    def host(self) -> HostTier: ...
    @property
    def disk(self) -> Tier | None: ...
    @property
    def _mu(self) -> threading.Lock: ...
    def _lock_found(self, keys: Sequence[bytes], count: bool = True) -> list[int | None]: ...
    def _publish(self, keys: list[bytes], from_remote: bool = False) -> set[bytes]: ...
    def _unpin(self, keys: list[bytes]) -> None: ...


@dataclass
class LinkCounters:
    """What the link did, beside the remote tier's own counters (hits, misses, errors, groups stored)."""

    probes: int = 0
    """EXISTS_CHAIN requests that reached the remote tier (the local tiers did not hold the whole chain)."""
    loads_started: int = 0
    """Blocks whose load from the remote tier into the host tier a probe started."""
    loads_failed: int = 0
    """Of those, blocks the load did not fill (gone from the server, damaged, server down): misses for the GET."""
    load_waits: int = 0
    """Client reads that waited for a block still being loaded."""
    no_room: int = 0
    """Remote blocks not loaded because no host slot could be freed (the probe's answer stops before them)."""
    unplaced: int = 0
    """Committed blocks of no remembered group (never in a chain probe, or forgotten): not sent."""


@dataclass
class HeldGroup:
    """A group on its way to the remote tier: nothing held (its blocks are found when the policy's thread reads
    them) or, under ``write_back``, its blocks' private copies made in the evicting transaction."""

    copies: list[Buffer] | None
    bytes_per_block: int

    @property
    def private_bytes(self) -> int:
        """Bytes of the private copies made already."""
        return 0 if self.copies is None else len(self.copies) * self.bytes_per_block


class HostGroups:
    """The daemon's :class:`~kvstore.lower.remote_write.GroupSource`: a group's blocks read from the backend's
    host slots (pinned, and loaded from disk first when only there) or, for a disk victim, through the
    evicting tier's reader."""

    def __init__(self, backend: LinkBackend) -> None:
        self.b = backend

    def hold(self, groups: Sequence[Group]) -> list[HeldGroup | None]:
        """Nothing to hold: :meth:`read` finds the blocks where they are then."""
        return [HeldGroup(None, self.b.layout.bytes_per_block) for _ in groups]

    def read(self, group: Group, held: HeldGroup) -> list[Buffer] | None:
        """The copies made already, or private copies of the group's host slots (disk blocks loaded into host
        first); ``None`` when a block is in no local tier."""
        if held.copies is not None:
            return held.copies
        b = self.b
        slots = b._lock_found(group, count=False)
        try:
            if None in slots:
                return None
            return [torch.empty(b.layout.bytes_per_block, dtype=torch.uint8).copy_(b.host.slot_view(s))
                    for s in slots if s is not None]
        finally:
            b._unpin([k for k, s in zip(group, slots) if s is not None])

    def copy_victims(self, groups: Sequence[Group], read: BlockReader) -> list[HeldGroup | None]:
        """Private copies of each group: disk blocks through ``read`` (the evicting transaction), the rest from
        host (written behind to disk, or not yet); ``None`` for a group one of whose blocks neither holds."""
        b = self.b
        out: list[HeldGroup | None] = []
        for group in groups:
            bufs = [torch.empty(b.layout.bytes_per_block, dtype=torch.uint8) for _ in group]
            found = read(list(group), bufs)
            if not all(found):
                missing = [i for i, f in enumerate(found) if not f]
                with b._mu:  # published copies only: a reserved slot is still being written
                    missing = [i for i in missing if b.host.slot_of(group[i]) is not None]
                    slots = b.host.pin([group[i] for i in missing], use=False)
                try:
                    for i, s in zip(missing, slots):
                        if s is not None:
                            bufs[i].copy_(b.host.slot_view(s))
                            found[i] = True
                finally:
                    b._unpin([group[i] for i, s in zip(missing, slots) if s is not None])
            out.append(HeldGroup(list(bufs), b.layout.bytes_per_block) if all(found) else None)
        return out

    def stored(self, group: Group, blocks: int) -> None:
        """Nothing to count beyond the remote tier's own counters."""


class RemoteLink:
    """The remote tier as one daemon uses it (see the module docstring). Thread-safe."""

    def __init__(self, backend: LinkBackend, remote: ChainTier, write: RemoteWrite, selective_hits: int,
                 max_queued_bytes: int, wait_s: float) -> None:
        self.b, self.remote, self.wait_s = backend, remote, wait_s
        self.g = remote.group_blocks
        self.groups = HostGroups(backend)
        self.policy: RemoteWritePolicy[HeldGroup] = RemoteWritePolicy(remote, self.groups, write, selective_hits,
                                                                      max_queued_bytes)
        """The one owner of ``remote.write`` (the embedded store's :class:`~kvstore.store.remote_writer.RemoteWriter`
        has one too)."""
        self.counters = LinkCounters()
        self._mu = threading.Lock()
        self._groups: OrderedDict[bytes, Group] = OrderedDict()
        """member key -> its group (one tuple shared by the group's members)."""
        self._loading: dict[bytes, threading.Event] = {}
        self._loads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-daemon-remote-load")
        """Loads on their own threads: a backlog of group stores (the policy's thread) never delays a load a
        client's GET waits for."""
        self._pending: set[Future[None]] = set()
        if write == "write_back":
            disk = backend.disk
            if disk is None or not disk.takes_victim_hook:
                raise ValueError("remote.write: write_back sends a group when its block leaves the daemon's last "
                                 "local tier, its disk tier; a daemon without one (tiers names no lmdb, file or "
                                 "slab) cannot see that: use write_through or write_through_selective")
            disk.set_victim_hook(self._disk_victims)

    @property
    def write(self) -> RemoteWrite:
        """The remote write policy's name (``remote.write``), as :attr:`policy` runs it."""
        return self.policy.write

    # ----------------------------------------------------------- lookups
    def after_local(self, chain: Sequence[bytes], n: int) -> int:
        """The probe of ``chain`` past its local prefix of ``n`` blocks: how many blocks from position 0 this
        daemon can serve (``n`` or more). Starts the loads of the remote blocks it counts."""
        self._remember(chain)
        self.policy.hit(chain, n)
        if n >= len(chain) // self.g * self.g:
            return n
        with self._mu:
            self.counters.probes += 1
        r = self.remote.probe(chain, n)
        if r <= n:
            return n
        return self._start_load(chain, n, r)

    def wait_loaded(self, keys: Sequence[bytes]) -> None:
        """Wait (bounded) until none of ``keys`` is still being loaded from the remote tier."""
        with self._mu:
            events = [e for k in keys if (e := self._loading.get(k)) is not None]
            if events:
                self.counters.load_waits += len(events)
        for e in events:
            e.wait(self.wait_s)

    def loading_any(self, keys: Sequence[bytes]) -> bool:
        """Whether a load of one of ``keys`` is in flight. Changes nothing."""
        with self._mu:
            return bool(self._loading) and any(k in self._loading for k in keys)

    # ------------------------------------------------------------ writes
    def on_committed(self, keys: Sequence[bytes]) -> None:
        """Clients stored ``keys`` (published in host): give the policy the remembered groups they belong to
        (under ``write_through`` it sends those not sent; a group not complete yet is tried again at its next
        commit or hit)."""
        if self.policy.write != "write_through":
            return
        groups: dict[bytes, Group] = {}
        with self._mu:
            for k in keys:
                group = self._groups.get(k)
                if group is None:
                    self.counters.unplaced += 1
                else:
                    groups[group[-1]] = group
        self.policy.committed(list(groups.values()))

    # ------------------------------------------------------------- misc
    def stats(self) -> dict[str, Any]:
        """The remote tier's counters (hits, misses, errors, ...) and the link's (``link``). Changes nothing."""
        out: dict[str, Any] = dict(self.remote.stats().as_dict())
        w = self.policy.counters
        with self._mu:
            out["link"] = {**asdict(self.counters), "groups_queued": w.queued, "groups_incomplete": w.incomplete,
                           "groups_shed": w.shed, "groups_remembered": len(self._groups) // max(1, self.g),
                           "loading": len(self._loading), "write": self.policy.write}
        return out

    def drain(self) -> None:
        """Wait for the loads and group stores queued before this call (a FLUSH's remote part: best effort,
        never an error: a failed store is counted by the tier)."""
        with self._mu:
            pending = list(self._pending)
        wait(pending)
        self.policy.wait()

    def close(self) -> None:
        """Finish queued work, stop the threads, close the remote tier."""
        if self.policy.write == "write_back" and self.b.disk is not None:
            self.b.disk.set_victim_hook(None)
        self._loads.shutdown(wait=True)
        self.policy.close()
        self.remote.close()

    # ---------------------------------------------------------- private
    def _remember(self, chain: Sequence[bytes]) -> None:
        groups = full_groups(chain, self.g)
        with self._mu:
            for group in groups:
                for k in group:
                    self._groups[k] = group
                    self._groups.move_to_end(k)
            while len(self._groups) > GROUP_MEMORY:
                self._groups.popitem(last=False)

    def _start_load(self, chain: Sequence[bytes], n: int, r: int) -> int:
        """Reserve host slots for positions ``[n, r)`` not held locally and load them on the link's thread;
        returns how far the daemon can serve (``r``, or where no slot could be freed)."""
        b = self.b
        on_disk = {k for k in chain[n:r] if b.disk is not None and b.disk.contains(k)}
        mine: dict[int, tuple[bytes, int]] = {}
        events: list[bytes] = []
        with b._mu, self._mu:
            for p in range(n, r):
                key = chain[p]
                if key in on_disk or key in self._loading or b.host.slot_of(key) is not None:
                    continue
                try:
                    slot = b.host.reserve([key])[0]
                except BlockStateError:
                    continue  # a client is writing it now: it will be there
                if slot is None:
                    self.counters.no_room += 1
                    r = p
                    break
                mine[p] = (key, slot)
                self._loading[key] = threading.Event()
                events.append(key)
            self.counters.loads_started += len(mine)
        if mine:
            self._submit(self._load, list(chain[: max(mine) // self.g * self.g + self.g]), mine)
        return r

    def _load(self, chain: list[bytes], mine: dict[int, tuple[bytes, int]]) -> None:
        b = self.b
        lo, hi = min(mine), max(mine) + 1
        scratch = torch.empty(b.layout.bytes_per_block, dtype=torch.uint8)
        dests: list[Buffer] = [b.host.slot_view(mine[p][1]) if p in mine else scratch for p in range(lo, hi)]
        try:
            ok = self.remote.load(chain, lo, dests)
        except Exception:  # a bug, not the server (the tier answers failures as misses): never leave slots reserved
            log.exception("remote load of %d blocks failed", len(mine))
            ok = [False] * (hi - lo)
        filled = [mine[p][0] for p in mine if ok[p - lo]]
        lost = [mine[p][0] for p in mine if not ok[p - lo]]
        try:
            with b._mu:
                b.host.abort(lost)
            b._publish(filled, from_remote=True)
        finally:
            with self._mu:
                self.counters.loads_failed += len(lost)
                for key, _ in mine.values():
                    e = self._loading.pop(key, None)
                    if e is not None:
                        e.set()

    def _disk_victims(self, keys: Sequence[bytes], read: BlockReader) -> VictimSend | None:
        """``write_back``: the disk tier is about to evict ``keys``; hand the policy each remembered group of
        theirs, copied in the evicting transaction (:meth:`HostGroups.copy_victims`)."""
        with self._mu:
            groups = [gr for k in keys if (gr := self._groups.get(k)) is not None]
        return self.policy.victims(groups, lambda due: self.groups.copy_victims(due, read))

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        fut = self._loads.submit(fn, *args)
        with self._mu:
            self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: Future[None]) -> None:
        with self._mu:
            self._pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("remote tier work failed", exc_info=fut.exception())


def link_for(backend: LinkBackend, remote: ChainTier | None, cfg: Any) -> RemoteLink | None:
    """The link a daemon with ``remote`` (built from ``cfg.remote``) uses, or ``None`` without one."""
    if remote is None:
        return None
    r = cfg.remote
    return RemoteLink(backend, remote, r.write, r.selective_hits, int(r.max_inflight_bytes),
                      LOAD_WAIT_FACTOR * r.timeout_s + r.probe_timeout_s)

