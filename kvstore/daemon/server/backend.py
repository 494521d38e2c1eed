"""The daemon's storage: its shared-memory host tier in front of its disk tier, with client holds.

Semantics of the one tier the daemon offers its clients:

- ``get``: served from the host tier; a host miss is loaded from disk into a
  freshly reserved host slot (published, so the next client finds it there).
- ``put``: lands in the host tier and goes to disk when the write policy makes it due
  (:mod:`kvstore.daemon.server.disk_writes`). Host and disk then hold distinct blocks; a block
  loaded from disk keeps its disk copy. ``flush`` writes every dirty block down, waits for the
  remote tier's sends (before and after: the disk writes' evictions may queue some), then syncs
  disk, and raises :class:`~kvstore.errors.NotDurable` when acknowledged blocks failed to reach it. With
  ``durable_puts`` (``disk.sync: always``) a put returns only after its blocks are written and
  synced, whatever the policy, and says ``False`` for any that were not.
- Holds end by release, connection close, process exit or deadline; expired write slots stay
  quarantined; each owner reserves within its share (:mod:`kvstore.daemon.server.client_slots`).

The backend composes those parts (:class:`DiskWrites`, :class:`ClientSlots`) and keeps the read and
write paths, which cross both tiers and the remote link.

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

import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from kvstore.daemon.server.backend_counters import BackendCounters
from kvstore.daemon.server.client_slots import ClientSlots
from kvstore.daemon.server.disk_writes import DiskWrites
from kvstore.daemon.server.dirty import DirtyBlocks
from kvstore.daemon.server.events import DaemonEvents
from kvstore.daemon.server.holds import HoldTable
from kvstore.daemon.server.locate import local_prefix
from kvstore.daemon.wire.messages import PutState, Runs
from kvstore.daemon.server.remote_link import RemoteLink
from kvstore.daemon.server.writer import WriteBehind
from kvstore.errors import BlockStateError
from kvstore.layout import KVLayout
from kvstore.lower.write_policy import WriteRule
from kvstore.tiers.base import Tier
from kvstore.tiers.host.tier import HostTier


class DaemonBackend:
    """Host (shared memory) + disk tiers and the hold table, behind one mutex."""

    def __init__(self, layout: KVLayout, host: HostTier, disk: Tier | None, holds: HoldTable,
                 durable_puts: bool = False, publish_events: bool = False, write: WriteRule | None = None) -> None:
        """``durable_puts``: acknowledge a put only once its blocks are on disk and synced (``disk.sync: always``):
        blocks are then written at commit whatever ``write`` says. ``publish_events``: keep :attr:`events` (what
        the tiers hold, in order) for a KV-events publisher to drain. ``write``: when a committed block goes to
        disk (``policy.write``; ``None``: its default, ``write_back``)."""
        self.layout, self.host, self.disk, self.holds = layout, host, disk, holds
        self.write = write or WriteRule()
        self.counters = BackendCounters()
        self._mu = threading.Lock()
        host.shed_guard = self._mu  # another layout's put evicts from this host tier only between our steps
        for tier in (host, disk):
            if tier is not None:
                tier.record_events(False)  # clients keep their own index; nobody drains unless events are published
        self.events = DaemonEvents(host, disk) if publish_events else None
        """The tiers' changes for a router (``daemon.events``), or ``None`` when nothing publishes them."""
        self.disk_writes = DiskWrites(host, disk, self._mu, self.counters, self.write, durable_puts, self.events)
        """The dirty blocks, the write-behind thread and the disk sync: the only owner of what is not on disk yet."""
        self.clients = ClientSlots(host, holds, self._mu, self.counters)
        """How clients' holds end, the quarantined write slots and each owner's share."""
        self.link: RemoteLink | None = None
        """The remote tier below host and disk (``tiers`` naming ``remote``), set by the server once built."""

    @property
    def durable_puts(self) -> bool:
        """A put is acknowledged only once its blocks are on disk and synced (:attr:`DiskWrites.durable_puts`)."""
        return self.disk_writes.durable_puts

    @property
    def dirty(self) -> DirtyBlocks | None:
        """The committed blocks not yet on disk, when blocks are not written at commit (:attr:`DiskWrites.dirty`)."""
        return self.disk_writes.dirty

    @property
    def writer(self) -> WriteBehind | None:
        """The write-behind thread, ``None`` without a disk tier (:attr:`DiskWrites.writer`)."""
        return self.disk_writes.writer

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
        runs = local_prefix(self.host, self.disk, keys)
        self._count_prefix(len(keys), runs)
        return runs

    def locate_chain(self, chain: Sequence[bytes], start: int) -> Runs:
        """The blocks of ``chain`` (its keys from position 0) this daemon can serve past the first ``start``
        (held by the client), as runs by tier: the local prefix from ``start``, then the remote tier's groups,
        whose loads into host start now (a GET of them waits for them). Without a remote tier,
        :meth:`locate_prefix` of ``chain[start:]``."""
        runs = local_prefix(self.host, self.disk, chain[start:])
        n = start + sum(k for _, k in runs)
        if self.link is not None:
            r = self.link.after_local(chain, n)
            if r > n:
                runs += (("remote", r - n),)
        self._count_prefix(len(chain) - start, runs)
        return runs

    def _count_prefix(self, asked: int, runs: Runs) -> None:
        """Count a lookup of ``asked`` blocks that found ``runs`` (tokens, in total and by tier)."""
        bs = self.layout.block_size
        with self._mu:
            c = self.counters
            c.prefix_query_tokens += asked * bs
            for tier, n in runs:
                c.prefix_hit_tokens += n * bs
                c.prefix_hit_tokens_by_tier[tier] = c.prefix_hit_tokens_by_tier.get(tier, 0) + n * bs

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
            due = self.disk_writes.hits([k for k, s in zip(keys, slots) if s is not None])
        self.holds.grant(owner, "read", [k for k, s in zip(keys, slots) if s is not None], time.monotonic())
        self.disk_writes.queue(due)
        return slots

    def touched(self, keys: Sequence[bytes]) -> int:
        """A client read ``keys`` out of the host tier through the slot directory, without a hold: count the
        hits and mark the blocks still published as used, as :meth:`hold_in_host` would have. Returns how
        many are still published (the rest were evicted since; their reads were proven whole or not used)."""
        with self._mu:
            n = self.host.touch(keys)
            self._count_reads(n, [0] * n, n)
            due = self.disk_writes.hits(keys)
        self.disk_writes.queue(due)
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

        Within ``owner``'s share (:meth:`ClientSlots.share`): absent keys beyond it, or all of them while one
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
            self.clients.end_quarantine(owner, [k for k, h in zip(keys, held) if not h])
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
        through = self.disk_writes.write_through([(k, b) for k, b, (st, _) in zip(keys, blocks, states)
                                                  if st == PutState.NO_ROOM])
        if self.link is not None and through:
            self.link.on_committed(through)
        done = set(through)
        return [st == PutState.PRESENT or (st == PutState.RESERVED and k not in failed) or k in done
                for k, (st, _) in zip(keys, states)]

    # ----------------------------------------------------------- holds ending
    def release(self, owner: int, keys: Sequence[bytes]) -> int:
        """End ``owner``'s holds on ``keys`` (:meth:`ClientSlots.release`). Returns how many ended."""
        return self.clients.release(owner, keys)

    def release_owner(self, owner: int) -> int:
        """End every hold and quarantined slot of ``owner``, whose process is gone (:meth:`ClientSlots.release_owner`)."""
        return self.clients.release_owner(owner)

    def end_connection(self, owner: int) -> int:
        """``owner``'s connection closed (:meth:`ClientSlots.end_connection`). Returns the read holds ended."""
        return self.clients.end_connection(owner)

    def expire(self) -> int:
        """End every hold past its deadline (:meth:`ClientSlots.expire`). Returns how many ended."""
        return self.clients.expire()

    def hold_limit(self) -> int:
        """Most hold references one connection may have at once (:meth:`ClientSlots.hold_limit`)."""
        return self.clients.hold_limit()

    def owned_by(self, owner: int) -> int:
        """Holds and quarantined slots ``owner`` has now (:meth:`ClientSlots.owned_by`). Changes nothing."""
        return self.clients.owned_by(owner)

    def idle(self) -> bool:
        """No hold and no quarantined slot: no client may still copy into or out of the arena (it may close)."""
        return self.clients.idle()

    # -------------------------------------------------------------- lifecycle
    def empty(self) -> bool:
        """:meth:`idle`, and no block in either tier nor queued for disk: closing loses nothing. Reads counters
        only (never waits for a disk write: called on the event loop)."""
        if not self.idle() or self.host.used_bytes():
            return False
        if self.writer is not None and self.writer.pending:
            return False
        return self.disk is None or self.disk.used_bytes() == 0

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
        return self.disk_writes.not_durable

    def flush(self, since: int = 0) -> int:
        """Write every committed block to disk (dirty ones first) and sync it; returns :attr:`not_durable` (the
        caller's next mark). The remote link is drained before the disk writes (its loads land in host and are
        written too) and after them (under ``remote.write: write_back`` their disk evictions queue sends, which
        this flush covers).

        Raises :class:`~kvstore.errors.NotDurable` when acknowledged blocks did not reach the disk (:meth:`DiskWrites.sync`):
        those whose write failed after the mark ``since`` (0 = since start), or every block written since the
        last good sync when the sync itself fails.
        """
        if self.link is not None:
            self.link.drain()
        if self.disk is None:
            return 0
        self.disk_writes.write_all_down()
        if self.link is not None:
            self.link.drain()
        return self.disk_writes.sync(since)

    def close(self) -> None:
        """Write dirty blocks down and wait for the writer, then close the remote link (its victim hook sends
        what those writes evicted), the writer and both tiers; the shared-memory segment is unlinked even when
        closing the disk tier fails (that error is raised afterwards)."""
        try:
            self.disk_writes.write_all_down()  # a restart finds them on disk
            if self.link is not None:
                self.link.close()
            self.disk_writes.close()
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
            out["quarantined_slots"] = self.clients.quarantined_slots()
        out.update(self.disk_writes.stats())
        out["write_policy"] = "write_through" if self.dirty is None and self.disk is not None else self.write.policy
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
        self.disk_writes.room_for_loads(keys)
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
                due = self.disk_writes.hits([k for k, s in zip(keys, slots) if s is not None])
                due += self.disk_writes.due_for_room()  # the disk loads took slots
        self.disk_writes.queue(due)
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
        self.disk_writes.rewrite_lost(keys)
        self.disk_writes.room_for(len(absent) - len(on_disk))
        refused = 0
        with self._mu:
            share = self.clients.share(owner) if owner is not None else None
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
            due = self.disk_writes.due_for_room()
        self.disk_writes.queue(due)
        if share is not None and refused:
            self.clients.log_refusal(share, refused)
        return out

    def _reserve_one(self, key: bytes) -> int | None:
        """Reserve one slot (mutex held); ``None`` when no slot can be freed; raises if someone else reserved it."""
        slot = self.host.reserve([key])[0]
        if slot is None:
            self.counters.no_room += 1
        return slot

    def _publish(self, keys: list[bytes], from_remote: bool = False) -> set[bytes]:
        """Make reserved keys visible and hand them to the disk writes (:meth:`DiskWrites.pin_committed`); a
        client's (not ``from_remote``: loaded from the remote tier) go to the remote tier too, as ``remote.write``
        says. With ``durable_puts``, a client's wait for their write; returns the keys that failed
        (:meth:`DiskWrites.write_committed`)."""
        if not keys:
            return set()
        with self._mu:
            self.host.publish(keys)
            if self.events is not None:
                self.events.stored(keys, "host")
            if not from_remote:
                self.counters.bytes_in += len(keys) * self.layout.bytes_per_block
            slots = self.disk_writes.pin_committed(keys)
        if self.link is not None and not from_remote:
            self.link.on_committed(keys)
        return self.disk_writes.write_committed(keys, slots, wait=not from_remote)

    def _unpin(self, keys: list[bytes]) -> None:
        with self._mu:
            self.host.unpin(keys)
