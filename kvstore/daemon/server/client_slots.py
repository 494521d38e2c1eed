"""How clients' claims on the daemon's host slots end: holds released, expired or orphaned, write slots
quarantined, and each owner's share of the slots it may reserve.

- A connection that ends with holds still open keeps them until their
  deadline, unless its process is known to be gone: then
  :meth:`ClientSlots.release_owner` ends them at once.
- A *write* hold past its deadline is not freed for another block: its
  writer maps the shared segment, and a writer paused between reserving and
  copying (a GC pause, swap, a stopped container) would copy into whatever
  block got the slot next. The slot stays reserved, *quarantined*, until
  its owner ends it (a late commit, refused, or a release: its copy is over),
  its process is known to be gone, or :data:`QUARANTINE_FACTOR` deadlines have
  passed (for a peer whose process the daemon cannot watch).
- One owner's write holds and quarantined slots together stay within its share of the host slots
  (:class:`~kvstore.daemon.server.share.ReserveShare`): a client that reserves and never commits, or stalls
  past its deadlines, leaves the other clients room for their puts instead of every slot for 30 deadlines.

:class:`ClientSlots` owns the quarantine; the hold table owns the holds, the host tier its slots. Its
changes to the host tier happen under the backend's mutex, which it is given (host state has one lock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kvstore.daemon.server.backend_counters import BackendCounters
from kvstore.daemon.server.holds import HOLDS_PER_SLOT, HoldTable
from kvstore.daemon.server.share import ReserveShare
from kvstore.tiers.host.tier import HostTier
from kvstore.util.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

QUARANTINE_FACTOR = 30
"""An expired write hold's slot is reused at the latest this many hold timeouts after it was granted."""
SHARE_LOG_INTERVAL_S = 10.0
"""Refusals beyond an owner's share are logged at most once per this many seconds (a hostile client repeats them)."""


class ClientSlots:
    """Ends clients' holds on ``host`` slots and keeps expired write slots quarantined, under ``mu``."""

    def __init__(self, host: HostTier, holds: HoldTable, mu: threading.Lock, counters: BackendCounters) -> None:
        """``mu``: the backend's mutex over every host-tier state change; ``counters``: where releases,
        quarantines and refusals are counted (under ``mu``)."""
        self.host, self.holds, self._mu, self.counters = host, holds, mu, counters
        self._quarantine: dict[int, dict[bytes, float]] = {}
        """owner -> keys of its expired write holds whose slots stay reserved, with when to free them anyway."""
        self._refusals = RateLimitedLog(log, SHARE_LOG_INTERVAL_S)

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
            self.end_quarantine(owner, [k for k, w in zip(rest, writes) if not w])
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

    def end_quarantine(self, owner: int, keys: Sequence[bytes]) -> None:
        """Free the quarantined slots of ``keys`` (``owner``'s copy into them is over: a late commit or a
        release)."""
        with self._mu:
            mine = self._quarantine.get(owner)
            if not mine:
                return
            done = [k for k in dict.fromkeys(keys) if mine.pop(k, None) is not None]
            self.host.abort(done)
            if not mine:
                del self._quarantine[owner]

    def idle(self) -> bool:
        """No hold and no quarantined slot: no client may still copy into or out of the arena. Changes nothing."""
        with self._mu:
            quarantined = bool(self._quarantine)
        return not quarantined and len(self.holds) == 0

    def owned_by(self, owner: int) -> int:
        """Holds and quarantined slots ``owner`` has now (what :meth:`release_owner` would end). Changes nothing."""
        with self._mu:
            quarantined = len(self._quarantine.get(owner, ()))
        return self.holds.owned_by(owner) + quarantined

    def quarantined_slots(self) -> int:
        """Slots quarantined now, of every owner (mutex held). Changes nothing."""
        return sum(len(keys) for keys in self._quarantine.values())

    def share(self, owner: int) -> ReserveShare:
        """``owner``'s part of the host slots in write holds and quarantine (mutex held). Changes nothing."""
        writes = self.holds.keys_held("write")
        quarantined = {o: len(keys) for o, keys in self._quarantine.items()}
        mine = writes.get(owner, 0), quarantined.get(owner, 0)
        others = sum(writes.values()) + sum(quarantined.values()) - sum(mine)
        return ReserveShare(owner, self.host.num_slots, others, *mine)

    def log_refusal(self, share: ReserveShare, refused: int) -> None:
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
