"""The daemon's way down from its host tier to its disk tier: the dirty blocks, the write-behind thread, and
the sync that makes a FLUSH durable.

A committed block goes to disk by the :class:`~kvstore.daemon.server.writer.WriteBehind` thread when the
write policy (``policy.write``, a :class:`~kvstore.lower.write_policy.WriteRule`) makes it due: at commit
under ``write_through``; under ``write_back`` it stays *dirty* (its slot pinned, so never evicted without a
disk copy) until host clean room falls below a low-water mark and the coldest dirty blocks are written back
ahead, or a reserve lacks room and writes back what it needs, or a flush or close; under
``write_through_selective`` the same, or once read ``selective_hits`` times (:mod:`kvstore.daemon.server.dirty`).
With ``durable_puts`` (``disk.sync: always``) every block is written at commit and its put waits for it.

:class:`DiskWrites` owns :attr:`~DiskWrites.dirty` and :attr:`~DiskWrites.writer`; the host slots they pin
change under the backend's mutex, which it is given (host state has one lock).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.daemon.server.backend_counters import BackendCounters
from kvstore.daemon.server.dirty import DirtyBlocks
from kvstore.daemon.server.events import DaemonEvents
from kvstore.daemon.server.writer import WriteBehind
from kvstore.errors import BlockStateError, NotDurable
from kvstore.lower.write_policy import WriteRule
from kvstore.tiers.base import Tier
from kvstore.tiers.host.tier import HostTier


ROOM_WAIT_S = 1.0
"""Longest a reserve or a disk load waits for the writer to make clean room: a stalled disk (full, paused, failing)
turns the wait into a ``NO_ROOM`` answer (the client then writes inline, through to disk, or misses) instead of
an executor thread held for as long as the disk stays stuck."""

class DiskWrites:
    """When committed ``host`` blocks are written to ``disk``, and the waits a flush or a reserve needs."""

    def __init__(self, host: HostTier, disk: Tier | None, mu: threading.Lock, counters: BackendCounters,
                 write: WriteRule, durable_puts: bool, events: DaemonEvents | None) -> None:
        """``mu``: the backend's mutex over every host-tier state change; ``counters``: where failed flushes are
        counted; ``durable_puts``: blocks are written at commit whatever ``write`` says; ``events``: told what
        reached the disk (``None``: nobody publishes). Without ``disk`` nothing is written and every wait is
        a no-op."""
        self.host, self.disk, self._mu, self.counters, self._events = host, disk, mu, counters, events
        self.durable_puts = durable_puts and disk is not None
        """Every block is written at commit and its put waits for it (``disk.sync: always``, with a disk tier)."""
        self.dirty = DirtyBlocks(write) if disk is not None and not write.at_commit and not durable_puts else None
        """The committed blocks not yet on disk, when blocks are not written at commit (else ``None``)."""
        self.writer = (WriteBehind(host, disk, self._written_down,
                                   on_written=self._written if events is not None else None)
                       if disk is not None else None)
        """The write-behind thread (``None`` without a disk tier)."""
        self._written_at_sync = 0

    @property
    def not_durable(self) -> int:
        """Acknowledged blocks whose disk write failed, since start (a mark for :meth:`sync`). Changes nothing."""
        return self.writer.not_durable if self.writer is not None else 0

    def hits(self, keys: Sequence[bytes]) -> list[bytes]:
        """Count lookups' hits of dirty ``keys``; those now due (``write_through_selective``), to queue. Mutex held."""
        return self.dirty.hit(keys) if self.dirty is not None else []

    def due_for_room(self) -> list[bytes]:
        """The coldest dirty keys to write back ahead when host clean room is low, to queue. Mutex held."""
        return self.dirty.due_for_room(self.host) if self.dirty is not None else []

    def queue(self, keys: Sequence[bytes]) -> None:
        """Queue ``keys`` (taken from :attr:`dirty`, their slots still pinned) to the writer, which unpins them.
        Call without the mutex (a pinned published key keeps its slot, so reading it needs none)."""
        if not keys:
            return
        assert self.writer is not None
        slots = [self.host.slot_of(k) for k in keys]
        self.writer.submit([(k, s) for k, s in zip(keys, slots) if s is not None])

    def room_for(self, n: int) -> None:
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
        self.queue(keys)
        if waiting:
            assert self.writer is not None
            self.writer.drain(ROOM_WAIT_S)  # a stuck disk: the reserve then answers NO_ROOM, never waits on it

    def room_for_loads(self, keys: Sequence[bytes]) -> None:
        """Before a read loads disk hits into host: make clean room for them (:meth:`room_for`), so a host tier
        full of dirty blocks makes the read slower, not a miss. Looks on disk only when room is short."""
        if self.dirty is None:
            return
        absent = [k for k in dict.fromkeys(keys) if self.host.slot_of(k) is None]
        if not absent or self.host.clean_room >= len(absent):
            return
        assert self.disk is not None
        self.room_for(sum(self.disk.contains(k) for k in absent))

    def pin_committed(self, keys: list[bytes]) -> list[int | None]:
        """``keys`` were just published (mutex held): pin their slots for the writer (nothing without a disk
        tier) and, when blocks are not written at commit, mark them dirty (pinned until written back). Returns
        the slots, for :meth:`write_committed` to take."""
        if self.writer is None:
            return []
        slots = self.host.pin(keys)
        if self.dirty is not None:
            self.dirty.add(keys)
        return slots

    def write_committed(self, keys: list[bytes], slots: list[int | None], wait: bool) -> set[bytes]:
        """After :meth:`pin_committed`, without the mutex: queue ``keys`` to the writer when blocks are written
        at commit, else queue the coldest dirty blocks when host clean room is low.

        With ``durable_puts`` and ``wait`` (a client's put, not a remote load), wait for their write and return
        the keys that failed (their host copies are dropped where no reader holds them, so a later put of the
        key stores it again); else return ``set()``.
        """
        if self.writer is None:
            return set()
        if self.dirty is not None:
            with self._mu:
                due = self.dirty.due_for_room(self.host)
            self.queue(due)
            return set()
        failed = set(self.writer.submit([(k, s) for k, s in zip(keys, slots) if s is not None],
                                        wait=self.durable_puts and wait))
        if failed:
            with self._mu:
                gone = []
                for key in failed:
                    try:
                        if self.host.delete([key]):
                            gone.append(key)
                    except BlockStateError:
                        pass  # a reader holds it; it goes when evicted
                if self._events is not None:
                    self._events.removed(gone, "host")
        return failed

    def write_through(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bytes]:
        """Write blocks the host tier had no room for (every slot pinned, waiting for its disk write, or
        held by readers) straight to the disk tier, and return the keys stored: a full host tier is a
        slower put, not a refused one (an engine that gets "not stored" keeps no lower copy of that prefix).
        Without a disk tier, nothing is stored."""
        if self.disk is None or not items:
            return []
        keys = list(dict.fromkeys(k for k, _ in items))
        first = dict(reversed(items))
        ok = self.disk.put(keys, [torch.frombuffer(bytearray(first[k]), dtype=torch.uint8) for k in keys])
        stored = [k for k, f in zip(keys, ok) if f]
        if stored and self.durable_puts:
            self.disk.flush()
        with self._mu:
            self.counters.written_through += len(stored)
            self.counters.bytes_in += len(stored) * self.host.bpb
        if self._events is not None and stored:
            self._events.stored(stored, "disk")
        return stored

    def rewrite_lost(self, keys: Sequence[bytes]) -> None:
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

    def write_all_down(self) -> None:
        """Queue every dirty block to the writer and wait until everything queued is written (or has failed):
        a flush's and a graceful close's disk writes. Call without the mutex."""
        if self.writer is None:
            return
        if self.dirty is not None:
            with self._mu:
                keys = self.dirty.take_all()
            self.queue(keys)
        self.writer.drain()

    def sync(self, since: int = 0) -> int:
        """Sync the disk tier (after :meth:`write_all_down`); returns :attr:`not_durable` (the caller's next mark).

        Raises :class:`~kvstore.errors.NotDurable` when acknowledged blocks did not reach the disk: those whose write
        failed after the mark ``since`` (a value an earlier call returned; 0 = since start), or, when
        the sync itself fails, every block written since the last good sync. Either is counted in
        ``flush_failures``.
        """
        if self.writer is None or self.disk is None:
            return 0
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
        """Stop the writer after it drained (dirty blocks stay unwritten: :meth:`write_all_down` first)."""
        if self.writer is not None:
            self.writer.close()

    def stats(self) -> dict[str, Any]:
        """Dirty blocks, those written ahead or on hits, pending and failed writes. Changes nothing."""
        with self._mu:
            out: dict[str, Any] = {
                "dirty_blocks": len(self.dirty) if self.dirty is not None else 0,
                "cleaned_ahead": self.dirty.cleaned_ahead if self.dirty is not None else 0,
                "written_on_hits": self.dirty.written_on_hits if self.dirty is not None else 0,
            }
        out["pending_writes"] = self.writer.pending if self.writer is not None else 0
        out["write_failures"] = self.writer.failed if self.writer is not None else 0
        return out

    def _written(self, keys: list[bytes]) -> None:
        """The write-behind thread stored ``keys`` on disk."""
        if self._events is not None:
            self._events.stored(keys, "disk")

    def _written_down(self, keys: list[bytes]) -> None:
        """The write-behind thread is done with ``keys`` (written or failed): unpin them; dirty ones are clean
        (or, failed, counted not durable by the writer) and evictable from now on."""
        with self._mu:
            self.host.unpin(keys)
            if self.dirty is not None:
                self.dirty.written(keys)
