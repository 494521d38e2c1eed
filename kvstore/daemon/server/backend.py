"""The daemon's storage: its shared-memory host tier in front of its disk tier, with client holds.

Semantics of the one tier the daemon offers its clients:

- ``get``: served from the host tier; a host miss is loaded from disk into a
  freshly reserved host slot (published, so the next client finds it there).
- ``put``: lands in the host tier and goes to disk by the :class:`WriteBehind`
  thread when the write policy (``policy.write``, a :class:`WriteRule`) makes it
  due: at commit under ``write_through``; under ``write_back`` it stays *dirty*
  (its slot pinned, so never evicted without a disk copy) until host clean room
  falls below a low-water mark and the coldest dirty blocks are written back
  ahead, or a reserve lacks room and writes back what it needs, or a flush or
  close; under ``write_through_selective`` the same, or once read
  ``selective_hits`` times (:mod:`kvstore.daemon.server.dirty`). Host and disk then
  hold distinct blocks; a block loaded from disk keeps its disk copy.
  ``flush`` queues every dirty block, waits for the queue, then syncs disk,
  and raises :class:`NotDurable` when acknowledged blocks failed to reach it.
  With ``durable_puts`` (``disk.sync: always``) a put returns only after its
  blocks are written and synced, whatever the policy, and says ``False`` for
  any that were not.
- A connection that ends with holds still open keeps them until their
  deadline, unless its process is known to be gone: then
  :meth:`DaemonBackend.release_owner` ends them at once.
- A *write* hold past its deadline is not freed for another block: its
  writer maps the shared segment, and a writer paused between reserving and
  copying (a GC pause, swap, a stopped container) would copy into whatever
  block got the slot next. The slot stays reserved, *quarantined*, until
  its owner ends it (a late commit, refused, or a release: its copy is over),
  its process is known to be gone, or ``QUARANTINE_FACTOR`` deadlines have
  passed (for a peer whose process the daemon cannot watch).
- One owner's write holds and quarantined slots together stay within its share of the host slots
  (:data:`RESERVE_SHARE`): a client that reserves and never commits, or stalls past its deadlines,
  leaves the other clients room for their puts instead of every slot for 30 deadlines.

Every host-tier state change (lock, reserve, publish, abort, evict inside
reserve) happens under one mutex, so "is it published?" and "lock it" are
one atomic step; the byte copies (disk into a slot, a slot into a reply)
happen outside it, on slots held by a lock or a reservation. All methods are
thread-safe. The server calls the ones that may wait for disk I/O from its
executor, and the ones that only take the mutex for microseconds
(:meth:`hold_in_host`, :meth:`release`, :meth:`commit` without
``durable_puts``, :meth:`reserve` without a disk tier) on its event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from kvstore.daemon.server.dirty import DirtyBlocks
from kvstore.daemon.server.events import DaemonEvents
from kvstore.daemon.server.holds import HOLDS_PER_SLOT, HoldTable
from kvstore.daemon.wire.messages import PutState, Runs
from kvstore.daemon.server.remote_link import RemoteLink
from kvstore.daemon.server.writer import WriteBehind
from kvstore.errors import BlockStateError, NotDurable
from kvstore.layout import KVLayout
from kvstore.lower.write_policy import WriteRule
from kvstore.util.ratelog import RateLimitedLog
from kvstore.tiers.base import Tier
from kvstore.tiers.host.tier import HostTier

log = logging.getLogger(__name__)

QUARANTINE_FACTOR = 30
"""An expired write hold's slot is reused at the latest this many hold timeouts after it was granted."""

RESERVE_SHARE = 2
"""An owner may hold at most 1/RESERVE_SHARE (rounded up) of the host slots that other owners leave (those not
in their write holds or quarantined) in write holds and quarantined slots of its own. A slot reserved is the
writer's until it commits, releases or is gone, so a grant cannot be taken back when another client needs
room; instead each grant leaves the others at least as many slots as it takes: one client that reserves
everything gets half, a second a quarter, and a well-behaved client still finds slots."""
SHARE_LOG_INTERVAL_S = 10.0
"""Refusals beyond an owner's share are logged at most once per this many seconds (a hostile client repeats them)."""

INTERNAL_OWNER = -1
"""Owner id of the daemon's own short-lived references (inline requests)."""


@dataclass
class BackendCounters:
    """Hits and misses as clients see them, per tier that answered."""

    host_hits: int = 0
    host_misses: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    no_room: int = 0
    """Keys a get or put could not serve because every host slot was pinned or reserved."""
    written_through: int = 0
    """Blocks of inline puts written straight to disk because the host tier had no room for them."""
    bytes_out: int = 0
    """Block bytes handed to clients (held slots and inline replies)."""
    bytes_in: int = 0
    """Block bytes clients stored (committed slots and inline puts)."""
    flush_failures: int = 0
    """FLUSH requests (and the shutdown flush) that reported blocks not durable."""
    owner_releases: int = 0
    """Holds and quarantined slots ended at once because the client process holding them was gone."""
    quarantined: int = 0
    """Write holds that expired, or whose connection closed, with their slot kept from reuse (the writer
    may still copy into it)."""
    share_refused: int = 0
    """Keys a reserve answered BUSY because their connection held its share of the host slots
    (:data:`RESERVE_SHARE`) or had quarantined slots (it let reservations expire and has not released them)."""
    connection_releases: int = 0
    """Read holds ended at once because the connection that held them closed."""
    prefix_query_tokens: int = 0
    """Tokens of the prefixes clients looked up (EXISTS_PREFIX keys x block size: the daemon sees keys, not tokens)."""
    prefix_hit_tokens: int = 0
    """Of those, the tokens of the leading blocks the daemon held (host or disk)."""


@dataclass(frozen=True)
class ReserveShare:
    """One owner's part of the host slots in write holds and quarantine, as it asks to reserve more."""

    owner: int
    slots: int
    """Host slots in all."""
    others: int
    """Slots other owners hold in write holds or quarantine."""
    reserved: int
    """Its own write holds."""
    quarantined: int
    """Its own quarantined slots."""

    @property
    def limit(self) -> int:
        """Most slots it may hold in write holds and quarantine: 1/:data:`RESERVE_SHARE` of what the others
        leave, rounded up (a lone owner of a one-slot arena may still write)."""
        return -(-max(0, self.slots - self.others) // RESERVE_SHARE)

    @property
    def room(self) -> int:
        """Slots it may reserve now: none while any of its slots is quarantined (its copies may be running)."""
        return 0 if self.quarantined else max(0, self.limit - self.reserved)


class DaemonBackend:
    """Host (shared memory) + disk tiers and the hold table, behind one mutex."""

    def __init__(self, layout: KVLayout, host: HostTier, disk: Tier | None, holds: HoldTable,
                 durable_puts: bool = False, publish_events: bool = False, write: WriteRule | None = None) -> None:
        """``durable_puts``: acknowledge a put only once its blocks are on disk and synced (``disk.sync: always``):
        blocks are then written at commit whatever ``write`` says. ``publish_events``: keep :attr:`events` (what
        the tiers hold, in order) for a KV-events publisher to drain. ``write``: when a committed block goes to
        disk (``policy.write``; ``None``: its default, ``write_back``)."""
        self.layout, self.host, self.disk, self.holds = layout, host, disk, holds
        self.durable_puts = durable_puts and disk is not None
        self.write = write or WriteRule()
        self.dirty = (DirtyBlocks(self.write) if disk is not None and not self.write.at_commit and not self.durable_puts
                      else None)
        """The committed blocks not yet on disk, when blocks are not written at commit (else ``None``)."""
        self.counters = BackendCounters()
        self._mu = threading.Lock()
        host.shed_guard = self._mu  # another layout's put evicts from this host tier only between our steps
        for tier in (host, disk):
            if tier is not None:
                tier.record_events(False)  # clients keep their own index; nobody drains unless events are published
        self.events = DaemonEvents(host, disk) if publish_events else None
        """The tiers' changes for a router (``daemon.events``), or ``None`` when nothing publishes them."""
        self.writer = (WriteBehind(host, disk, self._written_down,
                                   on_written=self._written if self.events is not None else None)
                       if disk is not None else None)
        self._written_at_sync = 0
        self._quarantine: dict[int, dict[bytes, float]] = {}
        """owner -> keys of its expired write holds whose slots stay reserved, with when to free them anyway."""
        self.link: RemoteLink | None = None
        """The remote tier below host and disk (``tiers`` naming ``remote``), set by the server once built."""
        self._refusals = RateLimitedLog(log, SHARE_LOG_INTERVAL_S)

    # ---------------------------------------------------------------- reads
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are in the host or disk tier (:meth:`locate_prefix`'s sum)."""
        return sum(n for _, n in self.locate_prefix(keys))

    def exists_chain(self, chain: Sequence[bytes], start: int) -> int:
        """How many blocks of ``chain`` from position 0 this daemon can serve (:meth:`locate_chain`'s sum plus
        ``start``)."""
        return start + sum(n for _, n in self.locate_chain(chain, start))

    def locate_prefix(self, keys: Sequence[bytes]) -> Runs:
        """The leading blocks of ``keys`` in the host or disk tier, as runs by the tier holding each.

        Changes only the prefix-cache counters (queried and hit tokens).
        """
        runs = self._local_prefix(keys)
        self._count_prefix(len(keys), sum(n for _, n in runs))
        return runs

    def locate_chain(self, chain: Sequence[bytes], start: int) -> Runs:
        """The blocks of ``chain`` (its keys from position 0) this daemon can serve past the first ``start``
        (held by the client), as runs by tier: the local prefix from ``start``, then the remote tier's groups,
        whose loads into host start now (a GET of them waits for them). Without a remote tier,
        :meth:`locate_prefix` of ``chain[start:]``."""
        runs = self._local_prefix(chain[start:])
        n = start + sum(k for _, k in runs)
        if self.link is not None:
            r = self.link.after_local(chain, n)
            if r > n:
                runs += (("remote", r - n),)
        self._count_prefix(len(chain) - start, sum(k for _, k in runs))
        return runs

    def _count_prefix(self, asked: int, found: int) -> None:
        with self._mu:
            self.counters.prefix_query_tokens += asked * self.layout.block_size
            self.counters.prefix_hit_tokens += found * self.layout.block_size

    def _local_prefix(self, keys: Sequence[bytes]) -> Runs:
        """The leading blocks of ``keys`` the host or disk tier holds, as runs by the faster tier holding each (the
        disk keeps a copy of most host blocks: a block in both is a host block). Changes nothing."""
        runs: list[tuple[str, int]] = []
        i, n, on_disk = 0, len(keys), 0  # keys[i:on_disk] are known to be on disk
        while i < n:
            step = self.host.contains_prefix(keys[i:])
            if step:
                runs.append(("host", step))
                i += step
                continue
            if on_disk <= i:
                step = self.disk.contains_prefix(keys[i:]) if self.disk is not None else 0
                if step == 0:
                    break
                on_disk = i + step
            j = i + 1  # keys[i] is on disk only; so are the keys after it up to the next one host holds
            while j < on_disk and not self.host.contains(keys[j]):
                j += 1
            runs.append(("disk", j - i))
            i = j
        return tuple(runs)

    def hold_for_read(self, owner: int, keys: Sequence[bytes]) -> list[int | None]:
        """Lock each found key's host slot for ``owner`` (loading disk hits into host first); ``None`` = miss.

        Every returned slot is a ``read`` hold in the table until RELEASE or its deadline.
        """
        slots = self._lock_found(keys)
        self.holds.grant(owner, "read", [k for k, s in zip(keys, slots) if s is not None], time.monotonic())
        return slots

    def hold_in_host(self, owner: int, keys: Sequence[bytes]) -> list[int | None] | None:
        """:meth:`hold_for_read` when it needs no disk read (every key is in the host tier, or there is
        no disk tier); otherwise ``None``, and nothing changed. Never waits for I/O, only for the mutex
        (held for microseconds), so the event loop calls it directly instead of paying an executor hop."""
        with self._mu:
            slots = [self.host.slot_of(k) for k in keys]
            if None in slots and (self.disk is not None or (self.link is not None and self.link.loading_any(keys))):
                return None
            self.host.pin([k for k, s in zip(keys, slots) if s is not None])
            self._count_reads(len(keys), slots, sum(s is not None for s in slots))
            due = self._hits([k for k, s in zip(keys, slots) if s is not None])
        self.holds.grant(owner, "read", [k for k, s in zip(keys, slots) if s is not None], time.monotonic())
        self._queue_dirty(due)
        return slots

    def touched(self, keys: Sequence[bytes]) -> int:
        """A client read ``keys`` out of the host tier through the slot directory, without a hold: count the
        hits and mark the blocks still published as used, as :meth:`hold_in_host` would have. Returns how
        many are still published (the rest were evicted since; their reads were proven whole or not used)."""
        with self._mu:
            n = self.host.touch(keys)
            self._count_reads(n, [0] * n, n)
            due = self._hits(keys)
        self._queue_dirty(due)
        return n

    def read_inline(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Copies of the found blocks (loading disk hits into host like :meth:`hold_for_read`)."""
        found, data = self.read_packed(keys)
        bpb, out, at = self.layout.bytes_per_block, [], 0
        for ok in found:
            out.append(bytes(data[at : at + bpb]) if ok else None)
            at += bpb if ok else 0
        return out

    def read_packed(self, keys: Sequence[bytes]) -> tuple[list[bool], bytearray]:
        """Which keys were found, and their blocks back to back in one buffer (GET_INLINE's reply body:
        one copy out of the slots, one allocation, returned to the system when freed). Loads disk hits
        into host like :meth:`hold_for_read`."""
        slots = self._lock_found(keys)
        try:
            around = self._read_around([k for k, s in zip(keys, slots) if s is None])
            hit = [s is not None or k in around for k, s in zip(keys, slots)]
            bpb = self.layout.bytes_per_block
            data = bytearray(sum(hit) * bpb)
            view = np.frombuffer(data, dtype=np.uint8)
            at = 0
            for key, slot, ok in zip(keys, slots, hit):
                if ok:
                    view[at : at + bpb] = self.host.slot_view(slot).numpy() if slot is not None else around[key]
                    at += bpb
            return hit, data
        finally:
            self._unpin([k for k, s in zip(keys, slots) if s is not None])

    def _read_around(self, keys: Sequence[bytes]) -> dict[bytes, np.ndarray]:
        """Disk blocks of ``keys`` (which found no host slot to load into: every one pinned or reserved, as
        when one read asks for more blocks than the host tier holds) read straight into private buffers, so
        a full host tier slows an inline read, it does not fail it. Counted as disk hits."""
        if self.disk is None or not keys:
            return {}
        todo = list(dict.fromkeys(keys))
        bufs = [torch.empty(self.layout.bytes_per_block, dtype=torch.uint8) for _ in todo]
        got = {k: b.numpy() for k, b, ok in zip(todo, bufs, self.disk.get(todo, bufs)) if ok}
        n = sum(k in got for k in keys)
        with self._mu:
            self.counters.disk_hits += n
            self.counters.disk_misses -= n
            self.counters.bytes_out += n * self.layout.bytes_per_block
        return got

    # --------------------------------------------------------------- writes
    def reserve(self, owner: int, keys: Sequence[bytes]) -> list[tuple[PutState, int | None]]:
        """Reserve a host slot per absent key for ``owner`` to write into (a ``write`` hold each).

        Within ``owner``'s share (:class:`ReserveShare`): absent keys beyond it, or all of them while one
        of its slots is quarantined, answer BUSY (a miss the client retries, never an error), counted in
        ``share_refused`` and logged naming the limit. Other owners' reserves are not affected. The share is
        read and the holds granted under the mutex, so owners reserving at once never both take one half.
        """
        return self._reserve(keys, owner)

    def commit(self, owner: int, keys: Sequence[bytes]) -> list[bool]:
        """Publish the keys ``owner`` reserved and queue them for disk; ``False`` for a key it did not hold
        (or, with ``durable_puts``, whose disk write failed)."""
        held = self.holds.take(owner, "write", keys)
        if not all(held):  # a late commit: the copy into a quarantined slot is over, the slot may go
            self._end_quarantine(owner, [k for k, h in zip(keys, held) if not h])
        failed = self._publish([k for k, h in zip(keys, held) if h])
        return [h and k not in failed for k, h in zip(keys, held)]

    def put_inline(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        """Store blocks given as bytes; ``result[i]`` says whether ``keys[i]`` is stored after the call."""
        states = self._reserve(keys)  # published at once: no hold, no share
        mine = [(k, b, s) for k, b, (st, s) in zip(keys, blocks, states) if st == PutState.RESERVED]
        try:
            for _, block, slot in mine:
                assert slot is not None
                self.host.slot_view(slot).numpy()[:] = np.frombuffer(block, dtype=np.uint8)
        except BaseException:
            with self._mu:
                self.host.abort([k for k, _, _ in mine])
            raise
        failed = self._publish([k for k, _, _ in mine])
        through = self._write_through([(k, b) for k, b, (st, _) in zip(keys, blocks, states) if st == PutState.NO_ROOM])
        return [st == PutState.PRESENT or (st == PutState.RESERVED and k not in failed) or k in through
                for k, (st, _) in zip(keys, states)]

    def _write_through(self, items: Sequence[tuple[bytes, memoryview]]) -> set[bytes]:
        """Write blocks the host tier had no room for (every slot pinned, waiting for its disk write, or
        held by readers) straight to the disk tier, and return the keys stored: a full host tier is a
        slower put, not a refused one (an engine that gets "not stored" keeps no lower copy of that prefix).
        Without a disk tier, nothing is stored."""
        if self.disk is None or not items:
            return set()
        keys = list(dict.fromkeys(k for k, _ in items))
        first = dict(reversed(items))
        ok = self.disk.put(keys, [torch.frombuffer(bytearray(first[k]), dtype=torch.uint8) for k in keys])
        stored = [k for k, f in zip(keys, ok) if f]
        if stored and self.durable_puts:
            self.disk.flush()
        with self._mu:
            self.counters.written_through += len(stored)
            self.counters.bytes_in += len(stored) * self.layout.bytes_per_block
        if self.events is not None and stored:
            self.events.stored(stored, "disk")
        if self.link is not None and stored:
            self.link.on_committed(stored)
        return set(stored)

    def release(self, owner: int, keys: Sequence[bytes]) -> int:
        """End ``owner``'s holds on ``keys``: unpin read holds, abort write reservations. Returns how many ended."""
        reads = self.holds.take(owner, "read", keys)
        rest = [k for k, r in zip(keys, reads) if not r]
        writes = self.holds.take(owner, "write", rest) if rest else []  # a get's release: all reads, as a rule
        with self._mu:
            self.host.unpin([k for k, r in zip(keys, reads) if r] if rest else keys)
            if rest:
                self.host.abort([k for k, w in zip(rest, writes) if w])
        if rest and not all(writes):
            self._end_quarantine(owner, [k for k, w in zip(rest, writes) if not w])
        return sum(reads) + sum(writes)

    def release_owner(self, owner: int) -> int:
        """End every hold ``owner`` has now (its process is gone): unpin reads, abort writes. Returns how many."""
        ended = self.holds.take_all(owner)
        with self._mu:
            for hold in ended:
                if hold.kind == "read":
                    self.host.unpin([hold.key])
                else:
                    self.host.abort([hold.key])
            quarantined = list(self._quarantine.pop(owner, {}))
            self.host.abort(quarantined)  # a gone process copies nothing more
            self.counters.owner_releases += len(ended) + len(quarantined)
        return len(ended) + len(quarantined)

    def hold_limit(self) -> int:
        """Most hold references one connection may have at once (:data:`HOLDS_PER_SLOT` per host slot)."""
        return HOLDS_PER_SLOT * self.host.num_slots

    def end_connection(self, owner: int) -> int:
        """``owner``'s connection closed: its read holds end now (a client copies out of a slot only while
        its connection is open, under the lock its close takes), and the slots of its write holds are
        quarantined as if they had expired (its process may be paused inside the copy) until that process
        exits (:meth:`release_owner`) or :data:`QUARANTINE_FACTOR` hold timeouts pass. Returns the read
        holds ended."""
        ended = self.holds.take_all(owner)
        backstop = time.monotonic() + QUARANTINE_FACTOR * self.holds.timeout_s
        with self._mu:
            reads = [h.key for h in ended if h.kind == "read"]
            self.host.unpin(reads)
            self.counters.connection_releases += len(reads)
            for hold in ended:
                if hold.kind == "write":
                    self._quarantine.setdefault(owner, {})[hold.key] = backstop
                    self.counters.quarantined += 1
        return len(reads)

    def idle(self) -> bool:
        """No hold and no quarantined slot: no client may still copy into or out of the arena (it may close)."""
        with self._mu:
            quarantined = bool(self._quarantine)
        return not quarantined and len(self.holds) == 0

    def empty(self) -> bool:
        """:meth:`idle`, and no block in either tier nor queued for disk: closing loses nothing. Reads counters
        only (never waits for a disk write: called on the event loop)."""
        if not self.idle() or self.host.used_bytes():
            return False
        if self.writer is not None and self.writer.pending:
            return False
        return self.disk is None or self.disk.used_bytes() == 0

    def owned_by(self, owner: int) -> int:
        """Holds and quarantined slots ``owner`` has now (what :meth:`release_owner` would end). Changes nothing."""
        with self._mu:
            quarantined = len(self._quarantine.get(owner, ()))
        return self.holds.owned_by(owner) + quarantined

    def expire(self) -> int:
        """End every hold past its deadline: unpin reads, quarantine writes; free quarantined slots past theirs.

        Returns how many holds ended.
        """
        now = time.monotonic()
        expired = self.holds.expire(now)
        backstop = now + (QUARANTINE_FACTOR - 1) * self.holds.timeout_s
        with self._mu:
            for hold in expired:
                if hold.kind == "read":
                    self.host.unpin([hold.key])
                else:
                    self._quarantine.setdefault(hold.owner, {})[hold.key] = backstop
                    self.counters.quarantined += 1
            for owner, keys in list(self._quarantine.items()):
                due = [k for k, t in keys.items() if t <= now]
                for k in due:
                    del keys[k]
                self.host.abort(due)
                if not keys:
                    del self._quarantine[owner]
        return len(expired)

    def _end_quarantine(self, owner: int, keys: Sequence[bytes]) -> None:
        """Free the quarantined slots of ``keys`` (``owner``'s copy into them is over)."""
        with self._mu:
            mine = self._quarantine.get(owner)
            if not mine:
                return
            done = [k for k in dict.fromkeys(keys) if mine.pop(k, None) is not None]
            self.host.abort(done)
            if not mine:
                del self._quarantine[owner]

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys from both tiers (host copies that are pinned stay); returns keys removed from either."""
        removed: set[bytes] = set()
        with self._mu:
            for key in dict.fromkeys(keys):
                if self.dirty is not None and self.dirty.discard(key):
                    self.host.unpin([key])  # its write-back pin: deleted, nothing is left to write
                try:
                    if self.host.delete([key]):
                        removed.add(key)
                except BlockStateError:
                    pass  # a client holds it now; it stays until evicted
            if self.events is not None:
                self.events.removed([k for k in dict.fromkeys(keys) if k in removed], "host")
        if self.disk is not None:
            on_disk = [k for k in dict.fromkeys(keys) if self.disk.contains(k)]
            self.disk.delete(on_disk)
            removed.update(on_disk)
            if self.events is not None:
                self.events.removed(on_disk, "disk")
        return len(removed)

    @property
    def not_durable(self) -> int:
        """Acknowledged blocks whose disk write failed, since start (a mark for :meth:`flush`). Changes nothing."""
        return self.writer.not_durable if self.writer is not None else 0

    def flush(self, since: int = 0) -> int:
        """Write every committed block to disk (dirty ones first queued: :meth:`_write_all_back`) and sync it;
        returns :attr:`not_durable` (the caller's next mark). The remote link is drained before the disk writes
        (its loads land in host and are written too) and after them (under ``remote.write: write_back`` their
        disk evictions queue sends, which this flush covers).

        Raises :class:`NotDurable` when acknowledged blocks did not reach the disk: those whose write
        failed after the mark ``since`` (a value an earlier call returned; 0 = since start), or, when
        the sync itself fails, every block written since the last good sync.
        """
        if self.link is not None:
            self.link.drain()  # remote loads land in host first, so their disk writes are queued below
        if self.writer is None or self.disk is None:
            return 0
        self._write_all_back()
        self.writer.drain()
        if self.link is not None:
            self.link.drain()  # the disk evictions of those writes may have queued remote sends (write_back)
        written, total = self.writer.written, self.writer.not_durable
        try:
            self.disk.flush()
        except Exception as exc:  # an fsync error: what was written since the last good sync may be gone
            with self._mu:
                self.counters.flush_failures += 1
            raise NotDurable(written - self._written_at_sync + total - since, total,
                             f"syncing the {self.disk.name} tier failed: {type(exc).__name__}: {exc}") from exc
        self._written_at_sync = written
        if total > since:
            with self._mu:
                self.counters.flush_failures += 1
            raise NotDurable(total - since, total,
                             f"their write to the {self.disk.name} tier failed ({self.writer.last_error})")
        return total

    def close(self) -> None:
        """Write dirty blocks down and wait for the writer, then close the remote link (its victim hook sends
        what those writes evicted), the writer and both tiers; the shared-memory segment is unlinked even when
        closing the disk tier fails (that error is raised afterwards)."""
        try:
            if self.writer is not None:
                self._write_all_back()  # a restart finds them on disk
                self.writer.drain()  # before the link closes: these writes' disk evictions are sent remote
            if self.link is not None:
                self.link.close()
            if self.writer is not None:
                self.writer.close()
            if self.disk is not None:
                self.disk.close()
        finally:
            self.host.close()

    def stats(self) -> dict[str, Any]:
        """Snapshot: per-tier counters and occupancy, client-view hits and misses, holds, pending writes."""
        out: dict[str, Any] = {"host": self.host.stats().as_dict(), "counters": asdict(self.counters)}
        out["disk"] = self.disk.stats().as_dict() if self.disk is not None else None
        out["remote"] = self.link.stats() if self.link is not None else None
        out["holds"] = len(self.holds)
        out["holds_expired"] = self.holds.expired_total
        with self._mu:
            out["quarantined_slots"] = sum(len(keys) for keys in self._quarantine.values())
            out["dirty_blocks"] = len(self.dirty) if self.dirty is not None else 0
            out["cleaned_ahead"] = self.dirty.cleaned_ahead if self.dirty is not None else 0
            out["written_on_hits"] = self.dirty.written_on_hits if self.dirty is not None else 0
        out["write_policy"] = "write_through" if self.dirty is None and self.disk is not None else self.write.policy
        out["pending_writes"] = self.writer.pending if self.writer is not None else 0
        out["write_failures"] = self.writer.failed if self.writer is not None else 0
        out["not_durable"] = self.not_durable
        out["durable_puts"] = self.durable_puts
        return out

    # -------------------------------------------------------------- private
    def _lock_found(self, keys: Sequence[bytes], count: bool = True) -> list[int | None]:
        """Lock the host slot of every found key (one reference per occurrence), loading disk hits first
        (and waiting for those the remote tier is loading). ``count=False``: the daemon's own read (a copy
        sent to the remote tier), not a client's: no hit or miss is counted, no use recorded."""
        if self.link is not None:
            self.link.wait_loaded(keys)
        self._room_for_loads(keys)
        loading: dict[bytes, int] = {}
        with self._mu:
            slots = [self.host.slot_of(k) for k in keys]
            self.host.pin([k for k, s in zip(keys, slots) if s is not None], use=count)
            if self.disk is not None:
                for key in dict.fromkeys(k for k, s in zip(keys, slots) if s is None):
                    try:
                        slot = self._reserve_one(key)
                    except BlockStateError:
                        continue  # being written by a client right now: a miss until it is committed
                    if slot is not None:
                        loading[key] = slot
        hits = sum(s is not None for s in slots)
        found: dict[bytes, int] = {}
        if loading:
            assert self.disk is not None
            ok = self.disk.get(list(loading), [self.host.slot_view(s) for s in loading.values()])
            found = {k: s for (k, s), f in zip(loading.items(), ok) if f}
        with self._mu:
            self.host.abort([k for k in loading if k not in found])
            self.host.publish(list(found))
            if self.events is not None:
                self.events.stored(list(found), "host")
            for i, key in enumerate(keys):
                if slots[i] is None and key in found:
                    self.host.pin([key], use=count)
                    slots[i] = found[key]
            due: list[bytes] = []
            if count:
                self._count_reads(len(keys), slots, hits)
                due = self._hits([k for k, s in zip(keys, slots) if s is not None])
                due += self._due_for_room()  # the disk loads took slots
        self._queue_dirty(due)
        return slots

    def _count_reads(self, n: int, slots: Sequence[int | None], host_hits: int) -> None:
        """Count a read of ``n`` keys that found ``slots`` (``host_hits`` of them in host). Mutex held."""
        c = self.counters
        found = sum(s is not None for s in slots)
        c.bytes_out += found * self.layout.bytes_per_block
        c.host_hits += host_hits
        c.host_misses += n - host_hits
        self.host.count_served(host_hits)  # the bytes leave through shared memory or a copy, never host.get
        if self.disk is not None:
            c.disk_hits += found - host_hits
            c.disk_misses += n - found

    def _reserve(self, keys: Sequence[bytes], owner: int | None = None) -> list[tuple[PutState, int | None]]:
        """A state per key, reserving slots for the absent ones: for ``owner`` within its share, granting its
        write holds; for the daemon itself (``None``: an inline put, published at once) as room allows."""
        absent = [k for k in dict.fromkeys(keys) if self.host.slot_of(k) is None]
        on_disk = {k for k in absent if self.disk is not None and self.disk.contains(k)}
        out: list[tuple[PutState, int | None]] = []
        seen: dict[bytes, PutState] = {}
        self._rewrite_lost(keys)
        self._room_for(len(absent) - len(on_disk))
        refused = 0
        with self._mu:
            share = self._share(owner) if owner is not None else None
            room = share.room if share is not None else len(keys)
            for key in keys:
                if key in seen:  # a repeated key: its first occurrence does the work
                    first = seen[key]
                    out.append((PutState.PRESENT if first == PutState.RESERVED else first, None))
                elif key not in on_disk and self.durable_puts and self.writer is not None and self.writer.is_pending(key):
                    out.append((PutState.BUSY, None))  # stored by another client, not durable yet: not "present"
                elif self.host.slot_of(key) is not None or key in on_disk:
                    out.append((PutState.PRESENT, None))
                elif room <= 0:  # beyond the owner's share: the others' room
                    out.append((PutState.BUSY, None))
                    refused += 1
                else:
                    try:
                        slot = self._reserve_one(key)
                    except BlockStateError:
                        out.append((PutState.BUSY, None))
                    else:
                        out.append((PutState.NO_ROOM, None) if slot is None else (PutState.RESERVED, slot))
                        if slot is not None:
                            room -= 1
                seen.setdefault(key, out[-1][0])
            if owner is not None:
                self.holds.grant(owner, "write", [k for k, (st, _) in zip(keys, out) if st == PutState.RESERVED],
                                 time.monotonic())
                self.counters.share_refused += refused
            due = self._due_for_room()
        self._queue_dirty(due)
        if share is not None and refused:
            self._log_refusal(share, refused)
        return out

    def _share(self, owner: int) -> ReserveShare:
        """``owner``'s part of the host slots in write holds and quarantine (mutex held). Changes nothing."""
        writes = self.holds.keys_held("write")
        quarantined = {o: len(keys) for o, keys in self._quarantine.items()}
        mine = writes.get(owner, 0), quarantined.get(owner, 0)
        others = sum(writes.values()) + sum(quarantined.values()) - sum(mine)
        return ReserveShare(owner, self.host.num_slots, others, *mine)

    def _log_refusal(self, share: ReserveShare, refused: int) -> None:
        """Say why ``refused`` keys of ``share.owner``'s reserve were answered BUSY (once per interval)."""
        if share.quarantined:
            self._refusals.warning("share", "client %d asked to reserve %d host slots, refused (BUSY): %d of its "
                                   "reservations expired and stay quarantined until it commits or releases them "
                                   "(or exits)", share.owner, refused, share.quarantined)
        else:
            self._refusals.warning("share", "client %d asked to reserve %d host slots beyond its share, refused "
                                   "(BUSY): a connection may hold at most half of the %d host slots other connections "
                                   "leave (%d), reserved and quarantined together", share.owner, refused,
                                   share.slots - share.others, share.limit)

    def _rewrite_lost(self, keys: Sequence[bytes]) -> None:
        """Queue again the host copies of ``keys`` whose acknowledged disk write failed.

        Such a key is still served from RAM, so a put of it answers "present"; without this, the
        FLUSH after that put would succeed with the block on no disk (a failed FLUSH, a retried put,
        a second FLUSH). Queued again, the block is either written or counted as failed once more,
        and the next FLUSH says which.
        """
        if self.writer is None:
            return
        lost = self.writer.lost_among(keys)
        if not lost:
            return
        with self._mu:
            held = [k for k in lost if self.host.slot_of(k) is not None]
            slots = self.host.pin(held) if held else []
        self.writer.forget([k for k in lost if k not in held])  # evicted meanwhile: the put stores it afresh
        self.writer.submit([(k, s) for k, s in zip(held, slots) if s is not None])

    def _reserve_one(self, key: bytes) -> int | None:
        """Reserve one slot (mutex held); ``None`` when no slot can be freed; raises if someone else reserved it."""
        slot = self.host.reserve([key])[0]
        if slot is None:
            self.counters.no_room += 1
        return slot

    def _publish(self, keys: list[bytes], from_remote: bool = False) -> set[bytes]:
        """Make reserved keys visible and pin them for the disk writer: queued now when blocks are written at
        commit, else dirty until written back (:mod:`kvstore.daemon.server.dirty`); a client's (not ``from_remote``:
        loaded from the remote tier) go to the remote tier too, as ``remote.write`` says.

        With ``durable_puts``, wait for their write and return the keys that failed (their host copies are
        dropped where no reader holds them, so a later put of the key stores it again); else return ``set()``.
        """
        if not keys:
            return set()
        with self._mu:
            self.host.publish(keys)
            if self.events is not None:
                self.events.stored(keys, "host")
            if not from_remote:
                self.counters.bytes_in += len(keys) * self.layout.bytes_per_block
            slots = self.host.pin(keys) if self.writer is not None else []
            due: list[bytes] = []
            if self.dirty is not None:
                self.dirty.add(keys)  # pinned until written back
                due = self.dirty.due_for_room(self.host)
        if self.link is not None and not from_remote:
            self.link.on_committed(keys)
        if self.writer is None:
            return set()
        if self.dirty is not None:
            self._queue_dirty(due)
            return set()
        failed = set(self.writer.submit([(k, s) for k, s in zip(keys, slots) if s is not None],
                                        wait=self.durable_puts and not from_remote))
        if failed:
            with self._mu:
                gone = []
                for key in failed:
                    try:
                        if self.host.delete([key]):
                            gone.append(key)
                    except BlockStateError:
                        pass  # a reader holds it; it goes when evicted
                if self.events is not None:
                    self.events.removed(gone, "host")
        return failed

    def _written(self, keys: list[bytes]) -> None:
        """The write-behind thread stored ``keys`` on disk."""
        if self.events is not None:
            self.events.stored(keys, "disk")

    def _unpin(self, keys: list[bytes]) -> None:
        with self._mu:
            self.host.unpin(keys)

    def _written_down(self, keys: list[bytes]) -> None:
        """The write-behind thread is done with ``keys`` (written or failed): unpin them; dirty ones are clean
        (or, failed, counted not durable by the writer) and evictable from now on."""
        with self._mu:
            self.host.unpin(keys)
            if self.dirty is not None:
                self.dirty.written(keys)

    # ------------------------------------------------------------- write-back
    def _hits(self, keys: Sequence[bytes]) -> list[bytes]:
        """Count lookups' hits of dirty ``keys``; those now due (``write_through_selective``), to queue. Mutex held."""
        return self.dirty.hit(keys) if self.dirty is not None else []

    def _due_for_room(self) -> list[bytes]:
        """The coldest dirty keys to write back ahead when host clean room is low, to queue. Mutex held."""
        return self.dirty.due_for_room(self.host) if self.dirty is not None else []

    def _queue_dirty(self, keys: Sequence[bytes]) -> None:
        """Queue ``keys`` (taken from :attr:`dirty`, their slots still pinned) to the writer, which unpins them.
        Call without the mutex (a pinned published key keeps its slot, so reading it needs none)."""
        if not keys:
            return
        assert self.writer is not None
        slots = [self.host.slot_of(k) for k in keys]
        self.writer.submit([(k, s) for k, s in zip(keys, slots) if s is not None])

    def _room_for(self, n: int) -> None:
        """Make clean room for a reserve of ``n`` slots: write back, and wait for, the coldest dirty blocks it
        lacks room for. A reserve past what was written ahead is then slower, not refused. Call without the
        mutex, from a thread that may wait for disk I/O (a reserve with a disk tier runs on the executor)."""
        if self.dirty is None or n <= 0:
            return
        with self._mu:
            clean = self.host.clean_room
            if clean >= n:
                return
            keys = self.dirty.coldest(self.host, n - clean - self.dirty.writing)
            waiting = self.dirty.writing > 0
        self._queue_dirty(keys)
        if waiting:
            assert self.writer is not None
            self.writer.drain()

    def _room_for_loads(self, keys: Sequence[bytes]) -> None:
        """Before a read loads disk hits into host: make clean room for them (:meth:`_room_for`), so a host tier
        full of dirty blocks makes the read slower, not a miss. Looks on disk only when room is short."""
        if self.dirty is None:
            return
        absent = [k for k in dict.fromkeys(keys) if self.host.slot_of(k) is None]
        if not absent or self.host.clean_room >= len(absent):
            return
        assert self.disk is not None
        self._room_for(sum(self.disk.contains(k) for k in absent))

    def _write_all_back(self) -> None:
        """Queue every dirty block to the writer (a flush, a graceful close). Call without the mutex."""
        if self.dirty is None:
            return
        with self._mu:
            keys = self.dirty.take_all()
        self._queue_dirty(keys)
