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
- each contender also runs a *miniature*: the same policy over the keys of a
  fixed hash sample (1 in :data:`SAMPLE`), with ``1 / SAMPLE`` of the
  budget, fed the tier's accesses to those keys. An access is a hit in the
  tier (``touch``) or a block coming back to the tier (``add``) that was not
  just loaded from it (a block loaded into the GPU under
  ``policy.exclusive_tiers`` comes back on demotion; that return is not a
  second request). A miniature that already holds the key scores a hit;
  otherwise it inserts the key and evicts by its own rules;
- scores halve every :data:`WINDOW` sampled accesses (recent behaviour
  counts), and the leader changes when another contender's score is higher.

A miniature's accesses are what the real tier sees, so it learns only from
requests that reached this tier: a policy whose miniature keeps blocks the
real tier has lost sees them again when they are recomputed and demoted
(``add``), which is how the documents of a cycle show up as hits for
S3-FIFO while GDSF leads.

Contenders: ``gdsf`` (:class:`~kvstore.tiers.gdsf.GDSFIndex`) and
``s3fifo`` with carried counts honoured (:class:`~kvstore.tiers.s3fifo.
S3FIFOIndex` ``seed_to_main=True``: a block seeded with two or more uses
skips the small queue, so under ``policy.carry_uses`` a popular block
demoted again keeps its place in main), and plain ``s3fifo`` (seeds
ignored, every block entering through the small queue: the variant that
keeps a fixed subset of a cycle).

Memory: one entry per resident key per contender (three), plus the
miniatures' ``3 / SAMPLE`` of that and their S3-FIFO ghosts: bounded by the
tier's own size. Time: each call costs the sum of the contenders' calls.
Not thread-safe; the owning tier holds its lock around every call.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from kvstore.tiers.exclude import Exclude
from kvstore.tiers.gdsf import GDSFIndex
from kvstore.tiers.s3fifo import S3FIFOIndex

SAMPLE = 16
"""One key in this many (by CRC-32 of the key) feeds the miniatures."""
WINDOW = 4096
"""Sampled accesses between halvings of the scores."""
MARGIN = 1.25
"""The leader changes when another contender's score exceeds the leader's times this."""


def _gdsf() -> GDSFIndex:
    return GDSFIndex()


def _s3fifo_seeded() -> S3FIFOIndex:
    return S3FIFOIndex(seed_to_main=True)


def _s3fifo() -> S3FIFOIndex:
    return S3FIFOIndex()


CONTENDERS: dict[str, Callable[[], GDSFIndex | S3FIFOIndex]] = {
    "gdsf": _gdsf, "s3fifo_seeded": _s3fifo_seeded, "s3fifo": _s3fifo,
}
"""The policies a :class:`DuelIndex` chooses between, by name; the first leads until another scores higher."""


class DuelIndex:
    """Keys ordered by whichever contender's miniature scores most hits; each key with its accounted bytes."""

    def __init__(self, contenders: Iterable[str] = tuple(CONTENDERS), sample: int = SAMPLE,
                 window: int = WINDOW, margin: float = MARGIN) -> None:
        """``contenders``: names in :data:`CONTENDERS` (at least two); ``sample``: 1 key in ``sample`` feeds
        the miniatures; ``window``: sampled accesses between halvings of the scores."""
        names = list(contenders)
        unknown = [n for n in names if n not in CONTENDERS]
        if len(names) < 2 or unknown or len(set(names)) != len(names):
            raise ValueError(f"DuelIndex needs two or more distinct contenders of {sorted(CONTENDERS)}, got {names}")
        if sample < 1 or window < 1:
            raise ValueError(f"need sample >= 1 and window >= 1, got {sample}, {window}")
        self.names = names
        self.sample = sample
        self.window = window
        self.margin = margin
        self._orders = [CONTENDERS[n]() for n in names]
        self._minis = [CONTENDERS[n]() for n in names]
        self.scores = [0.0] * len(names)
        """Miniature hits per contender, halved every ``window`` sampled accesses."""
        self.leader = 0
        """Index in :attr:`names` of the contender whose ``victims`` the tier gets."""
        self._accesses = 0
        self._mini_budget: int | None = None  # budget / sample, known once victims() was asked
        self._loaded: OrderedDict[bytes, None] = OrderedDict()  # sampled keys touched, not yet back
        self.switches = 0
        """How many times the leader changed."""
        self.used = 0
        """Sum of the accounted sizes of the keys held (every contender's ``used``)."""

    # ------------------------------------------------------------- reading
    @property
    def leader_name(self) -> str:
        """The name of the contender now choosing victims."""
        return self.names[self.leader]

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
        is a block just loaded from here coming back)."""
        if key not in self._orders[0] and self._sampled(key):
            if key in self._loaded:
                del self._loaded[key]
            else:
                self._access(key, size)
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
        if self._sampled(key):
            size = self._orders[0].size_of(key) or 1
            self._access(key, size)
            self._loaded[key] = None
            self._loaded.move_to_end(key)
            bound = max(64, 4 * len(self._minis[0]))
            while len(self._loaded) > bound:
                self._loaded.popitem(last=False)
        for order in self._orders:
            order.touch(key)
        return True

    def seed(self, key: bytes, uses: int) -> bool:
        """Pass ``key``'s carried count to every contender and miniature that holds it; ``False`` if absent."""
        if key not in self._orders[0]:
            return False
        for order in self._orders:
            order.seed(key, uses)
        if self._sampled(key):
            for mini in self._minis:
                mini.seed(key, uses)
        return True

    def remove(self, key: bytes) -> int | None:
        """Forget ``key`` in every contender (the miniatures keep their own membership); its size or ``None``."""
        size = None
        for order in self._orders:
            size = order.remove(key)
        self.used = self._orders[0].used
        return size

    def victims(self, need: int, budget: int, exclude: Exclude = ()) -> list[bytes]:
        """The leader's victims (its side effects: S3-FIFO reorders its queues, GDSF raises ``L``); the other
        contenders change nothing until the caller removes the keys."""
        self._mini_budget = max(1, budget // self.sample)
        return self._orders[self.leader].victims(need, budget, exclude)

    # ---------------------------------------------------------- miniatures
    def _sampled(self, key: bytes) -> bool:
        return zlib.crc32(key) % self.sample == 0

    def _access(self, key: bytes, size: int) -> None:
        """One request of sampled ``key`` reached this tier: score each miniature that holds it, insert it in
        the others (evicting by their own rules once the budget is known)."""
        for i, mini in enumerate(self._minis):
            if mini.touch(key):
                self.scores[i] += 1
                continue
            if self._mini_budget is not None:
                for victim in mini.victims(size, self._mini_budget):
                    mini.remove(victim)
            mini.add(key, size)
        self._accesses += 1
        if self._accesses % self.window == 0:
            self.scores = [s / 2 for s in self.scores]
        best = max(range(len(self.scores)), key=self.scores.__getitem__)
        if self.scores[best] > self.scores[self.leader] * self.margin:
            self.leader = best
            self.switches += 1
