"""The scoring half of a ``duel`` order: miniatures of each contender, their hits, and which one leads.

A :class:`~kvstore.policy.duel.DuelIndex` keeps a full order per contender
over its tier's keys and asks a :class:`DuelReferee` which one chooses
victims. The referee runs the contenders' miniatures (one policy each, over
the keys of a fixed 1-in-``sample`` hash sample, with ``1 / sample`` of the
budget), scores each miniature's hits, halves the scores every ``window``
sampled accesses and hands the lead to a contender whose score exceeds the
leader's by ``margin``.

Two scopes (a placement policy's ``shared_duel``):

- private: each duel tier has a private referee (one level), whose
  miniatures see only that tier's accesses.
- shared (``adaptive``): the host tier and the disk tier share one referee of two
  levels (host 0, disk 1). Its miniatures model the pair as one cache of
  the host + disk capacity, counted in blocks, and its leader chooses
  victims in both tiers. A tier's own miniature learns only from its own
  hits: a host duel alone picks the policy that keeps more blocks on host,
  even when that loses more hits on disk than it gains (measured in
  docs/BENCHMARKS.md "hitrate"); the shared referee scores the hits of the
  whole space below the GPU.

An *access* of the miniatures is a request that reached the tiers the
referee scores:

- a hit at any level (:meth:`touched`);
- a block entering a level (:meth:`added`) that is not a move inside the
  scored space: not a block just loaded from a level coming back (under
  exclusive tiers a loaded block returns on demotion), and not a
  block an upper level just gave up arriving at a lower one (a host victim
  spilled to disk).

A miniature that holds the key scores a hit; otherwise it inserts the key
and evicts by its own rules once the budget is known (every level has asked
for victims at least once). The remembered keys (loaded, given up) are
bounded by 4x the miniature's size.

Not thread-safe. A private referee lives under its tier's lock; a shared
one is called by two tiers, each under its own lock, so it takes its own
lock around every call (cheap: only sampled keys reach it past the hash).
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable

from kvstore.policy.gdsf import LINEAR, CountWeight, GDSFIndex
from kvstore.policy.s3fifo import S3FIFOIndex

SAMPLE = 16
"""One key in this many (by CRC-32 of the key) feeds the miniatures."""
WINDOW = 4096
"""Sampled accesses between halvings of the scores."""
MARGIN = 1.25
"""The leader changes when another contender's score exceeds the leader's times this."""


SHARED_MARGIN = 1.1
""":data:`MARGIN` of a referee shared below the GPU (:func:`~kvstore.policy.duel.shared_duel`): its
miniatures score the hits of host and disk together, where a policy's lead is smaller than in one tier's."""


def _gdsf(ghost_loaded: bool, weight: CountWeight) -> GDSFIndex:
    return GDSFIndex(weight)


def _s3fifo_seeded(ghost_loaded: bool, weight: CountWeight) -> S3FIFOIndex:
    return S3FIFOIndex(seed_to_main=True, ghost_loaded=ghost_loaded)


def _s3fifo(ghost_loaded: bool, weight: CountWeight) -> S3FIFOIndex:
    return S3FIFOIndex(ghost_loaded=ghost_loaded)


CONTENDERS: dict[str, Callable[[bool, CountWeight], GDSFIndex | S3FIFOIndex]] = {
    "gdsf": _gdsf, "s3fifo_seeded": _s3fifo_seeded, "s3fifo": _s3fifo,
}
"""The policies a duel chooses between, by name, each built with or without S3-FIFO's ``ghost_loaded``
(:attr:`DuelReferee.ghost_loaded`) and with GDSF's count weight (:attr:`DuelReferee.weight`); the first
leads until another scores higher."""


class DuelReferee:
    """Miniatures, scores and the leader of a duel over ``levels`` stacked tiers (1: a private referee)."""

    def __init__(self, contenders: Iterable[str] = tuple(CONTENDERS), sample: int = SAMPLE,
                 window: int = WINDOW, margin: float = MARGIN, levels: int = 1, ghost_loaded: bool = False,
                 ghost_victims: bool = False, weight: CountWeight = LINEAR) -> None:
        """``contenders``: names in :data:`CONTENDERS` (at least two); ``sample``: 1 key in ``sample`` feeds
        the miniatures; ``window``: sampled accesses between halvings of the scores; ``levels``: how many
        tiers share the referee, 0 the uppermost (the host tier); ``ghost_loaded``: the tiers' S3-FIFO
        contenders remember a loaded block in their ghost (:class:`~kvstore.policy.s3fifo.S3FIFOIndex`), so a
        block that went up to the GPU and came back returns to main; ``ghost_victims``: the tiers' S3-FIFO
        contenders that do not lead put the leader's victims from their small queue in their ghost
        (:meth:`~kvstore.policy.duel.DuelIndex.remove`); ``weight``: the GDSF contender's count weight
        (:class:`~kvstore.policy.gdsf.CountWeight`, a placement policy's ``weight``), in the tiers' orders and the
        miniature alike."""
        names = list(contenders)
        unknown = [n for n in names if n not in CONTENDERS]
        if len(names) < 2 or unknown or len(set(names)) != len(names):
            raise ValueError(f"DuelIndex needs two or more distinct contenders of {sorted(CONTENDERS)}, got {names}")
        if sample < 1 or window < 1 or levels < 1:
            raise ValueError(f"need sample >= 1, window >= 1 and levels >= 1, got {sample}, {window}, {levels}")
        self.names = names
        self.sample = sample
        self.window = window
        self.margin = margin
        self.levels = levels
        self.ghost_loaded = ghost_loaded
        self.ghost_victims = ghost_victims
        self.weight = weight
        self._minis = [CONTENDERS[n](False, weight) for n in names]  # a miniature sees no loads, only accesses
        self.scores = [0.0] * len(names)
        """Miniature hits per contender, halved every ``window`` sampled accesses."""
        self.leader = 0
        """Index in :attr:`names` of the contender whose ``victims`` every level's tier gets."""
        self.switches = 0
        """How many times the leader changed."""
        self._accesses = 0
        self._budgets: list[int | None] = [None] * levels  # each level's budget (blocks when shared), once known
        self._loaded: OrderedDict[bytes, None] = OrderedDict()  # sampled keys hit, not yet back
        self._given_up: OrderedDict[bytes, None] = OrderedDict()  # sampled keys an upper level evicted
        self._tiers: list[Container[object]] = []  # each level's order, to tell a copy moving down from an access
        self._lock = threading.Lock() if levels > 1 else None

    def attach(self, level: int, order: Container[object]) -> None:
        """Register ``order`` as level ``level``'s keys (:class:`~kvstore.policy.duel.DuelIndex` does, in level order)."""
        if level != len(self._tiers):
            raise ValueError(f"level {level} attached out of order (next is {len(self._tiers)})")
        self._tiers.append(order)

    @property
    def leader_name(self) -> str:
        """The name of the contender now choosing victims."""
        return self.names[self.leader]

    @property
    def mini_budget(self) -> int | None:
        """Each miniature's budget: the levels' budgets summed, over :attr:`sample`; ``None`` until each is known."""
        if any(b is None for b in self._budgets):
            return None
        return max(1, sum(b for b in self._budgets if b is not None) // self.sample)

    def new_order(self, name: str) -> GDSFIndex | S3FIFOIndex:
        """A new, empty full order of contender ``name`` for a tier this referee scores."""
        return CONTENDERS[name](self.ghost_loaded, self.weight)

    def sampled(self, key: bytes) -> bool:
        """Whether ``key`` feeds the miniatures (a fixed hash sample). Changes nothing."""
        return zlib.crc32(key) % self.sample == 0

    # ---------------------------------------------------------- reports
    def budget(self, level: int, budget: int, used: int, count: int) -> None:
        """Level ``level`` is about to evict under ``budget`` (its units), holding ``count`` keys of ``used``
        units. A shared referee counts blocks: a level's budget is converted at its mean accounted size."""
        if self.levels == 1:
            self._budgets[0] = budget
            return
        self._budgets[level] = budget if used <= count or count == 0 else budget * count // used

    def added(self, level: int, key: bytes, size: int) -> None:
        """Sampled ``key`` entered level ``level`` (it was not there): an access unless a move (see module). A
        key an upper level still holds is a copy moving down: the store writes it below before the upper
        level lets it go (the simulator removes it first; both are the same move)."""
        with self._locked():
            if key in self._loaded:
                del self._loaded[key]
                return
            # The other level's keys are read without its tier's lock: one dict lookup (atomic under the GIL); a
            # stale answer can only mislabel one sampled access, never corrupt the order.
            if any(key in upper for upper in self._tiers[:level]):
                return
            if key in self._given_up:
                del self._given_up[key]
                if level > 0:
                    return  # an upper level's victim arriving below
            self._access(key, size)

    def touched(self, key: bytes, size: int) -> None:
        """Sampled ``key`` was hit at some level: an access, and the key is remembered as loaded."""
        with self._locked():
            self._access(key, size)
            self._remember(self._loaded, key)

    def removed(self, level: int, key: bytes) -> None:
        """Sampled ``key`` left level ``level``: from an upper level, not loaded and not already below, it may
        arrive below (a move)."""
        if level < self.levels - 1:
            with self._locked():
                if key not in self._loaded and not any(key in lower for lower in self._tiers[level + 1 :]):
                    self._remember(self._given_up, key)

    def seeded(self, key: bytes, uses: int) -> None:
        """Pass sampled ``key``'s carried count to every miniature that holds it."""
        with self._locked():
            for mini in self._minis:
                mini.seed(key, uses)

    # ---------------------------------------------------------- internals
    def _locked(self) -> threading.Lock | _NoLock:
        return self._lock if self._lock is not None else _NO_LOCK

    def _remember(self, keys: OrderedDict[bytes, None], key: bytes) -> None:
        keys[key] = None
        keys.move_to_end(key)
        bound = max(64, 4 * len(self._minis[0]))
        while len(keys) > bound:
            keys.popitem(last=False)

    def _access(self, key: bytes, size: int) -> None:
        """One request of sampled ``key`` reached the scored tiers: score each miniature that holds it, insert
        it in the others (evicting by their own rules once the budget is known)."""
        if self.levels > 1:
            size = 1  # a shared referee counts blocks (the levels account in different units)
        budget = self.mini_budget
        for i, mini in enumerate(self._minis):
            if mini.touch(key):
                self.scores[i] += 1
                continue
            if budget is not None:
                for victim in mini.victims(size, budget):
                    mini.remove(victim)
            mini.add(key, size)
        self._accesses += 1
        if self._accesses % self.window == 0:
            self.scores = [s / 2 for s in self.scores]
        best = max(range(len(self.scores)), key=self.scores.__getitem__)
        if self.scores[best] > self.scores[self.leader] * self.margin:
            self.leader = best
            self.switches += 1


class _NoLock:
    """The context manager a private referee uses instead of a lock (its tier's lock covers it)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LOCK = _NoLock()
