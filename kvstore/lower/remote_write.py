"""The remote tier's write policy (``remote.write``): the one owner of which groups go remote, and when.

The remote tier stores ``G = remote.group_blocks`` consecutive blocks of a chain as one value, under the key of
the group's last block (:mod:`kvstore.tiers.chain`). A :class:`Group` is those ``G`` keys::

    chain   k0 k1 k2 k3 | k4 k5 k6 k7 | k8 k9        (G = 4)
    groups  (k0..k3)      (k4..k7)      -            a partial group never goes remote

Under each policy a group is due:

- ``write_through``: once its last block is committed (:meth:`RemoteWritePolicy.committed`), or at a local hit
  if it was not sent yet (:meth:`RemoteWritePolicy.hit`: it was committed before its chain was known, or its
  send failed);
- ``write_through_selective``: once local hits on it reach ``remote.selective_hits`` (counted here, per group);
- ``write_back``: when one of its blocks is about to lose its last local copy (:meth:`RemoteWritePolicy.victims`:
  a disk tier's victim hook, or the GPU or host tier with no tier below); its blocks are copied to private
  buffers at once, in the evicting thread, and sent later;
- ``read_only``: never.

A group is sent once (:data:`SENT_MEMORY` last keys remembered, the least recently sent forgotten first);
a send that did not store it (a block gone from every local tier, a server error) forgets it again, so a later
commit, hit or eviction sends it then. ``write_back`` copies waiting for a send are bounded
(:attr:`RemoteWritePolicy.max_queued_bytes`): past it a group is shed (counted, not remembered).

What differs between the embedded store and the daemon is not here but in a :class:`GroupSource` each gives:
how a group's blocks are held until the send and read into private buffers (the store: GPU, host or disk under
the hierarchy lock; the daemon: its host slots or disk). How a user finds a block's group (the store from the
radix path, the daemon from the chains its probes showed) is its own too: it hands this class groups.

Every send runs on this policy's one thread, after the group's blocks were copied to private buffers and their
holds given back: a slow, dead or paused server never makes a client, the engine or an evicting thread wait.
Thread-safe; lock order: a user's own locks, then this class's (never held while calling the source).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from kvstore.config.write_policy import SELECTIVE_HITS_DEFAULT, WritePolicy
from kvstore.tiers.base import Buffer, VictimSend
from kvstore.tiers.chain import ChainTier

log = logging.getLogger(__name__)

RemoteWrite = WritePolicy | Literal["read_only"]
"""The remote tier's write policies (``remote.write``)."""

SENT_MEMORY = 1 << 16
"""Last keys of the groups a policy remembers having sent or counted hits for (least recently seen forgotten
first): about 10 MB of bookkeeping for 256k groups' worth of chains."""

MAX_QUEUED_BYTES = 256 << 20
"""Default bound on the bytes of ``write_back`` copies waiting for (or in) a send; a group beyond it is shed
(built from config, ``remote.max_inflight_bytes``)."""

Group = tuple[bytes, ...]
"""The keys of ``G`` consecutive chain positions ``[i*G, i*G+G)``, stored remotely under the last one."""


def full_groups(chain: Sequence[bytes], g: int, stop: int | None = None) -> list[Group]:
    """The full groups of ``chain[:stop]`` (``chain`` from position 0), in order. Changes nothing."""
    n = len(chain) if stop is None else min(stop, len(chain))
    return [tuple(chain[i: i + g]) for i in range(0, n // g * g, g)]


def completed_groups(chain: Sequence[bytes], first_new: int, g: int) -> list[Group]:
    """The full groups of ``chain`` (from position 0) that positions ``[first_new, len(chain))``, just committed,
    complete: those whose last position is new (a group full before the commit was complete already)."""
    first = first_new // g * g
    return [tuple(chain[s: s + g]) for s in range(first, len(chain) // g * g, g) if s + g - 1 >= first_new]


class Held(Protocol):
    """A group on its way to the remote tier, as its :class:`GroupSource` keeps it until the send."""

    @property
    def private_bytes(self) -> int:
        """Bytes of private copies it carries already (``write_back``): counted against ``max_queued_bytes``."""
        ...


H = TypeVar("H", bound=Held)


class GroupSource(Protocol[H]):
    """What differs between the policy's users: how a group's blocks are held and read (the embedded store's
    GPU, host and disk under its hierarchy lock; the daemon's host slots and disk tier). Each method is called
    without the policy's lock held."""

    def hold(self, groups: Sequence[Group]) -> list[H | None]:
        """Keep each group's blocks readable until :meth:`read` (a reference, a pin: no copy, no I/O), or
        ``None`` for a group one of whose blocks is in no local tier. Called on the caller's thread."""
        ...

    def read(self, group: Group, held: H) -> list[Buffer] | None:
        """Private copies of the group's ``G`` blocks, giving back what :meth:`hold` took (always, also on
        failure); ``None`` when one could not be read. Called on the policy's thread."""
        ...

    def stored(self, group: Group, blocks: int) -> None:
        """The remote tier stored (or already had) ``blocks`` blocks of ``group``: count it. Called on the
        policy's thread."""
        ...


@dataclass
class WriteCounters:
    """What the policy did, beside the remote tier's own counters (``groups_stored``, ``errors``)."""

    queued: int = 0
    """Groups handed to the policy's thread to send."""
    incomplete: int = 0
    """Due groups not sent because a block had left every local tier (or could not be read)."""
    shed: int = 0
    """``write_back`` groups dropped unsent because :attr:`RemoteWritePolicy.max_queued_bytes` of copies were
    waiting already."""


@dataclass
class _Seen:
    """What the policy remembers of one group (by its last key)."""

    hits: int = 0
    """Local hits counted (``write_through_selective``)."""
    sent: bool = False
    """Scheduled or sent; cleared when the send did not store it."""


Job = tuple[Group, H]


class RemoteWritePolicy(Generic[H]):
    """Sends full groups to ``remote`` under the policy ``write`` (see the module docstring); ``source`` holds and
    reads their blocks. Thread-safe."""

    def __init__(self, remote: ChainTier, source: GroupSource[H], write: RemoteWrite = "write_through",
                 selective_hits: int = SELECTIVE_HITS_DEFAULT, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.remote = remote
        self.source = source
        self.write: RemoteWrite = write
        self.selective_hits = selective_hits
        self.max_queued_bytes = max_queued_bytes
        """Most bytes of private copies (``write_back``) queued or being sent at once: a slow server makes
        further groups shed (counted), never the tier that evicts wait or memory grow."""
        self.g = remote.group_blocks
        self.counters = WriteCounters()
        self._mu = threading.Lock()
        self._seen: OrderedDict[bytes, _Seen] = OrderedDict()  # group's last key -> what is known of it
        self._queued_bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-remote-write")
        self._pending: set[Future[None]] = set()

    # ------------------------------------------------------------ triggers
    def committed(self, groups: Sequence[Group]) -> None:
        """Under ``write_through``: ``groups`` are complete now (a commit's last block): send those not sent
        yet. Other policies: nothing."""
        if self.write == "write_through" and groups:
            self._send_held(self._claim(groups))

    def hit(self, chain: Sequence[bytes], n: int) -> None:
        """A lookup found ``chain``'s first ``n`` blocks (``chain`` from position 0) in local tiers. Under
        ``write_through_selective`` count a hit on each full group among them and send those reaching
        ``selective_hits``; under ``write_through`` send those not sent yet. Other policies: nothing."""
        if self.write not in ("write_through", "write_through_selective"):
            return
        g = self.g
        due: list[Group] = []
        with self._mu:
            for end in range(g, n // g * g + 1, g):
                last = chain[end - 1]
                seen = self._seen.get(last)
                if self.write == "write_through_selective":
                    if seen is None:
                        seen = self._seen[last] = _Seen()
                    seen.hits += 1
                    self._seen.move_to_end(last)
                    if seen.hits >= self.selective_hits and not seen.sent:
                        due.append(tuple(chain[end - g: end]))
                elif seen is None or not seen.sent:
                    due.append(tuple(chain[end - g: end]))
                else:
                    self._seen.move_to_end(last)  # a hot group stays remembered: never sent again
            self._trim()
        if due:
            self._send_held(self._claim(due))

    def victims(self, groups: Sequence[Group], copy: Callable[[Sequence[Group]], list[H | None]]) -> VictimSend | None:
        """Under ``write_back``: a block of each of ``groups`` is about to lose its last local copy. ``copy``
        makes private copies of the groups it is given, those not sent yet (now, on the evicting thread, with
        whatever locks it holds; ``None``: a block is in no local tier); returns the send that queues them, to
        call once the blocks are gone (``None`` when nothing is to be sent). Never waits for the server.
        Other policies: ``None``."""
        if self.write != "write_back" or not groups:
            return None
        with self._mu:
            due = list({gr[-1]: gr for gr in groups if not self._sent(gr[-1])}.values())
        if not due:
            return None
        jobs: list[Job[H]] = []
        incomplete = 0
        for gr, held in zip(due, copy(due)):
            if held is None:
                incomplete += 1
            else:
                jobs.append((gr, held))
        if incomplete:
            with self._mu:
                self.counters.incomplete += incomplete
        return (lambda: self._send_copies(jobs)) if jobs else None

    # --------------------------------------------------------------- upkeep
    def pending(self) -> bool:
        """Whether group sends are scheduled or running."""
        with self._mu:
            return bool(self._pending)

    def wait(self) -> None:
        """Block until every send scheduled before the call has finished (a failed one is logged and counted
        by the tier, never raised)."""
        with self._mu:
            pending = list(self._pending)
        wait(pending)

    def close(self) -> None:
        """Finish the scheduled sends and stop the thread (the remote tier stays open: its owner closes it)."""
        self._pool.shutdown(wait=True)

    # -------------------------------------------------------------- private
    def _sent(self, last: bytes) -> bool:
        seen = self._seen.get(last)
        return seen is not None and seen.sent

    def _remember(self, last: bytes) -> None:
        """Record ``last``'s group as sent (under the lock)."""
        seen = self._seen.get(last)
        if seen is None:
            seen = self._seen[last] = _Seen()
        seen.sent = True
        self._seen.move_to_end(last)

    def _trim(self) -> None:
        while len(self._seen) > SENT_MEMORY:
            self._seen.popitem(last=False)

    def _forget(self, last: bytes) -> None:
        """The send of ``last``'s group did not store it: a later trigger may send it again (its hits stay)."""
        with self._mu:
            seen = self._seen.get(last)
            if seen is not None:
                seen.sent = False

    def _claim(self, groups: Sequence[Group]) -> list[Group]:
        """Record the groups of ``groups`` not sent yet as sent, so that a concurrent trigger does not send them
        too; returns them."""
        with self._mu:
            due = list({gr[-1]: gr for gr in groups if not self._sent(gr[-1])}.values())
            for gr in due:
                self._remember(gr[-1])
            self._trim()
        return due

    def _send_held(self, groups: list[Group]) -> None:
        """Hold ``groups`` (claimed) through the source and queue their send; a group it cannot hold is
        counted incomplete and forgotten."""
        if not groups:
            return
        jobs: list[Job[H]] = []
        for gr, held in zip(groups, self.source.hold(groups)):
            if held is None:
                with self._mu:
                    self.counters.incomplete += 1
                self._forget(gr[-1])
            else:
                jobs.append((gr, held))
        self._submit(jobs)

    def _send_copies(self, jobs: list[Job[H]]) -> None:
        """The send :meth:`victims` returns: queue the copied groups not sent meanwhile, shedding those past
        :attr:`max_queued_bytes`."""
        admitted: list[Job[H]] = []
        with self._mu:
            for gr, held in jobs:
                if self._sent(gr[-1]):
                    continue
                if self._queued_bytes + held.private_bytes > self.max_queued_bytes:
                    self.counters.shed += 1
                    continue
                self._queued_bytes += held.private_bytes
                self._remember(gr[-1])
                admitted.append((gr, held))
            self._trim()
        self._submit(admitted)

    def _submit(self, jobs: list[Job[H]]) -> None:
        if not jobs:
            return
        with self._mu:
            self.counters.queued += len(jobs)
            fut = self._pool.submit(self._write, jobs)
            self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: Future[None]) -> None:
        with self._mu:
            self._pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("remote write failed", exc_info=fut.exception())

    def _write(self, jobs: list[Job[H]]) -> None:
        """Copy every group's blocks to private buffers (the holds given back), then send them one by one.

        The holds last only as long as the copies, never a network round trip."""
        copied: list[tuple[Group, list[Buffer]]] = []
        try:
            for gr, held in jobs:
                try:
                    bufs = self.source.read(gr, held)
                except Exception:  # a failed copy loses an optimisation, never an engine error
                    log.exception("reading group ending %s for the remote tier failed", gr[-1].hex()[:16])
                    bufs = None
                if bufs is None:
                    with self._mu:
                        self.counters.incomplete += 1
                    self._forget(gr[-1])
                else:
                    copied.append((gr, bufs))
            for gr, bufs in copied:
                try:
                    stored = self.remote.store(list(gr), 0, bufs)
                except Exception:  # as above (the tier answers a server's failures itself)
                    log.exception("writing group ending %s to the remote tier failed", gr[-1].hex()[:16])
                    stored = 0
                if stored:
                    self.source.stored(gr, stored)
                else:
                    self._forget(gr[-1])
        finally:
            with self._mu:
                self._queued_bytes -= sum(held.private_bytes for _, held in jobs)
