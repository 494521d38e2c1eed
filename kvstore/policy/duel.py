"""An eviction order that picks its policy online: GDSF or S3-FIFO, whichever a miniature of each hits more.

No single order wins every workload (docs/BENCHMARKS.md "hitrate"): GDSF
keeps what is used often (conversations, agent loops, template traffic),
S3-FIFO's small queue keeps a fixed subset when documents come back in a
cycle longer than the cache, which frequency cannot tell apart. ARC adapts
between recency and frequency; this order adapts between whole policies,
with the miniature-simulation idea of Waldspurger et al. (ATC'17):

- every contender is a full order over the tier's keys (the same
  ``add`` / ``touch`` / ``seed`` / ``remove`` reach each), and ``victims``
  asks the current :attr:`leader` only, so switching costs nothing and
  never moves a block;
- under a shared referee (:func:`shared_duel`) the leader's victims are
  every contender's: an S3-FIFO contender that does not lead puts a victim
  from its small queue in its ghost, as its own walk would have, so when it
  takes the lead it knows which blocks came back (without it, a document
  cycle's blocks re-entered its small queue once more after the switch; a
  private referee's tier keeps the old rule, under which docqa-random did
  better: docs/BENCHMARKS.md "hitrate");
- each contender also runs a *miniature*: the same policy over the keys of a
  fixed hash sample (1 in :data:`SAMPLE`), with ``1 / SAMPLE`` of the
  budget, fed the tier's accesses to those keys. An access is a hit in the
  tier (``touch``) or a block coming back to the tier (``add``) that was not
  just loaded from it (a block loaded into the GPU under
  exclusive tiers comes back on demotion; that return is not a
  second request). A miniature that already holds the key scores a hit;
  otherwise it inserts the key and evicts by its own rules;
- scores halve every :data:`WINDOW` sampled accesses (recent behaviour
  counts), and the leader changes when another contender's score is higher.

A miniature's accesses are what the real tier sees, so it learns only from
requests that reached this tier: a policy whose miniature keeps blocks the
real tier has lost sees them again when they are recomputed and demoted
(``add``), which is how the documents of a cycle show up as hits for
S3-FIFO while GDSF leads.

Contenders: ``gdsf`` (:class:`~kvstore.policy.gdsf.GDSFIndex`) and
``s3fifo`` with carried counts honoured (:class:`~kvstore.policy.s3fifo.
S3FIFOIndex` ``seed_to_main=True``: a block seeded with two or more uses
skips the small queue, so under a placement policy's ``carry_uses`` a popular block
demoted again keeps its place in main), and plain ``s3fifo`` (seeds
ignored, every block entering through the small queue: the variant that
keeps a fixed subset of a cycle).

The miniatures, their scores and the leader live in a
:class:`~kvstore.policy.duel_referee.DuelReferee`: private to the tier by
default, or shared by the host and disk tiers (a shared duel (``adaptive``), :func:`shared_duel`), whose miniatures then model the two
tiers as one cache and whose leader chooses victims in both.

Memory: one entry per resident key per contender (three), plus the
miniatures' ``3 / SAMPLE`` of that and their S3-FIFO ghosts: bounded by the
tier's own size. Time: each call costs the sum of the contenders' calls.
Not thread-safe; the owning tier holds its lock around every call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvstore.policy.duel_referee import CONTENDERS, MARGIN, SAMPLE, SHARED_MARGIN, WINDOW, DuelReferee
from kvstore.policy.exclude import Exclude
from kvstore.policy.gdsf import LINEAR, CountWeight
from kvstore.policy.s3fifo import S3FIFOIndex

__all__ = ["CONTENDERS", "MARGIN", "SAMPLE", "SHARED_MARGIN", "WINDOW", "DuelIndex", "DuelReferee", "shared_duel"]


class DuelIndex:
    """Keys ordered by whichever contender's miniature scores most hits; each key with its accounted bytes."""

    def __init__(self, contenders: Iterable[str] = tuple(CONTENDERS), sample: int = SAMPLE,
                 window: int = WINDOW, margin: float = MARGIN, *, referee: DuelReferee | None = None,
                 level: int = 0, weight: CountWeight = LINEAR) -> None:
        """``contenders``, ``sample``, ``window``, ``margin``, ``weight`` (GDSF's count weight): a private
        :class:`DuelReferee`'s (see there); ``referee``: a shared one instead (its contenders and weight are
        used), this tier being its level ``level`` (0: the uppermost)."""
        if referee is None:
            referee = DuelReferee(contenders, sample, window, margin, weight=weight)
        if not 0 <= level < referee.levels:
            raise ValueError(f"level {level} outside the referee's {referee.levels} levels")
        self.referee = referee
        """Who scores the miniatures and names the leader (private, or shared with the tiers below the GPU)."""
        self.level = level
        self._orders = [referee.new_order(n) for n in referee.names]
        referee.attach(level, self._orders[0])  # every contender holds the same keys
        self._victims: set[bytes] = set()  # the leader's last victims, not removed yet (kept under ghost_victims)
        self._budget = 0  # the budget of the last victims call
        self.used = 0
        """Sum of the accounted sizes of the keys held (every contender's ``used``)."""

    # ------------------------------------------------------------- reading
    @property
    def names(self) -> list[str]:
        """The contenders' names, in the referee's order."""
        return self.referee.names

    @property
    def leader(self) -> int:
        """Index in :attr:`names` of the contender whose ``victims`` the tier gets."""
        return self.referee.leader

    @property
    def leader_name(self) -> str:
        """The name of the contender now choosing victims."""
        return self.referee.leader_name

    @property
    def scores(self) -> list[float]:
        """The referee's miniature hits per contender."""
        return self.referee.scores

    @property
    def switches(self) -> int:
        """How many times the referee's leader changed."""
        return self.referee.switches

    def __contains__(self, key: object) -> bool:
        return key in self._orders[0]

    def __len__(self) -> int:
        return len(self._orders[0])

    def __iter__(self) -> Iterator[bytes]:
        """Keys in the leader's iteration order. Changes nothing."""
        return iter(self._orders[self.leader])

    def size_of(self, key: bytes) -> int | None:
        """Accounted size of ``key``, or ``None``."""
        return self._orders[0].size_of(key)

    def oldest(self, n: int, exclude: Exclude = ()) -> list[bytes]:
        """The leader's :meth:`oldest`. Changes nothing."""
        return self._orders[self.leader].oldest(n, exclude)

    # ------------------------------------------------------------ changing
    def add(self, key: bytes, size: int) -> None:
        """Insert ``key`` in every contender (a block entering the tier: an access of the miniatures, unless it
        is a move, see :meth:`DuelReferee.added`)."""
        if key not in self._orders[0] and self.referee.sampled(key):
            self.referee.added(self.level, key, size)
        for order in self._orders:
            order.add(key, size)
        self.used = self._orders[0].used

    def add_oldest(self, key: bytes, size: int) -> None:
        """Insert ``key`` as the next to evict in every contender (reopen; not an access)."""
        for order in self._orders:
            order.add_oldest(key, size)
        self.used = self._orders[0].used

    def touch(self, key: bytes) -> bool:
        """Record a hit of ``key`` in every contender and the miniatures; ``False`` if absent."""
        if key not in self._orders[0]:
            return False
        if self.referee.sampled(key):
            self.referee.touched(key, self._orders[0].size_of(key) or 1)
        for order in self._orders:
            order.touch(key)
        return True

    def seed(self, key: bytes, uses: int) -> bool:
        """Pass ``key``'s carried count to every contender and miniature that holds it; ``False`` if absent."""
        if key not in self._orders[0]:
            return False
        for order in self._orders:
            order.seed(key, uses)
        if self.referee.sampled(key):
            self.referee.seeded(key, uses)
        return True

    def remove(self, key: bytes) -> int | None:
        """Forget ``key`` in every contender (the miniatures keep their own membership); its size or ``None``.
        Under a referee with ``ghost_victims`` (:func:`shared_duel`) a victim the leader chose is, for an S3-FIFO
        contender that does not lead, a victim too (:meth:`~kvstore.policy.s3fifo.S3FIFOIndex.remove_evicted`:
        from its small queue into its ghost), so the contender that takes the lead later knows which blocks
        came back, as if it had chosen all along."""
        evicted = key in self._victims
        if evicted:
            self._victims.discard(key)
        size = None
        for i, order in enumerate(self._orders):
            if evicted and i != self.leader and isinstance(order, S3FIFOIndex):
                size = order.remove_evicted(key, self._budget)
            else:
                size = order.remove(key)
        self.used = self._orders[0].used
        if size is not None and self.referee.sampled(key):
            self.referee.removed(self.level, key)
        return size

    def victims(self, need: int, budget: int, exclude: Exclude = ()) -> list[bytes]:
        """The leader's victims (its side effects: S3-FIFO reorders its queues, GDSF raises ``L``); the other
        contenders change nothing until the caller removes the keys."""
        self.referee.budget(self.level, budget, self.used, len(self))
        out = self._orders[self.leader].victims(need, budget, exclude)
        if self.referee.ghost_victims:
            self._victims = set(out)
            self._budget = budget
        return out


def shared_duel(levels: int = 2, weight: CountWeight = LINEAR) -> list[DuelIndex]:
    """One :class:`DuelIndex` per tier below the GPU, uppermost first, sharing one :class:`DuelReferee`
    (``adaptive``: one duel for host and disk): one choice of policy, scored on the hits of all of them, with
    :data:`SHARED_MARGIN`, S3-FIFO's ``ghost_loaded`` (the tiers form one cache: a block loaded from it
    and demoted back is a returning block, not a new one) and ``ghost_victims`` (a trailing S3-FIFO contender
    remembers the leader's victims); ``weight``: GDSF's count weight (a placement policy's ``weight``)."""
    if levels < 2:
        raise ValueError(f"a shared duel needs two or more tiers, got {levels}")
    referee = DuelReferee(levels=levels, margin=SHARED_MARGIN, ghost_loaded=True, ghost_victims=True, weight=weight)
    return [DuelIndex(referee=referee, level=i) for i in range(levels)]
