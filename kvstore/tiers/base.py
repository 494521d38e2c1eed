"""The interface every tier below the GPU implements, and the registry that names them.

A tier stores whole blocks (``KVLayout.bytes_per_block`` raw bytes each) under
their 32-byte chained keys. Because keys are content addresses, ``put`` of a
key that is already present is a no-op and the stored bytes never change.

Calls are batched; each docstring says what it changes. Synchronous methods
may block on I/O; ``get_async``/``put_async`` run the same work on the tier's
own thread pool and return a :class:`concurrent.futures.Future`, so an engine
never blocks on a disk.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from kvstore.errors import TierError
from kvstore.layout import KVLayout

Buffer = torch.Tensor
"""A destination or source of exactly ``bytes_per_block`` bytes: a contiguous ``uint8`` tensor."""
MAX_QUEUED_EVENTS = 65_536
"""Most undrained events a tier keeps; older ones are dropped (and counted) so an undrained queue never grows."""

BlockReader = Callable[[Sequence[bytes], Sequence[Buffer]], list[bool]]
"""Reads stored blocks into buffers as :meth:`Tier.get` does (``result[i]``: ``dests[i]`` filled, verified),
without counting hits or changing recency. A victim hook's reader is valid only during the hook's call."""

Located = tuple[tuple[str | None, int], ...]
"""Blocks found from the first key asked for, as ``(name, blocks)`` runs in key order: which of a tier's
:attr:`Tier.served_as` holds them, or ``None`` for the tier itself (:meth:`Tier.locate_prefix`)."""

VictimSend = Callable[[], None]
"""What a victim hook hands back: called once the victims are really gone (their deletion committed),
outside the tier's write lock; dropped unrun if the deletion did not happen."""

VictimHook = Callable[[Sequence[bytes], BlockReader], VictimSend | None]
"""Called by a tier that evicts on its own with the keys it is about to evict and a reader that still sees
them (the same LMDB transaction as the deletion): the last moment their bytes exist in this tier. It may
read them (and other stored keys) and must not call back into the tier; a hook that raises is logged and
the eviction proceeds. See :meth:`Tier.set_victim_hook`."""


@dataclass
class TierStats:
    """Counters of one tier since it was opened. Mutable; read a snapshot with :meth:`Tier.stats`."""

    hits: int = 0
    """Keys found by ``get``."""
    misses: int = 0
    """Keys asked of ``get`` and not found (corrupt entries count here too)."""
    bytes_read: int = 0
    """Raw block bytes delivered by ``get``."""
    bytes_written: int = 0
    """Raw block bytes accepted by ``put``."""
    puts: int = 0
    """Blocks newly stored."""
    evictions: int = 0
    """Blocks removed to respect the capacity."""
    corrupt_dropped: int = 0
    """Stored values that failed a header or checksum check, deleted and reported as misses."""
    read_errors: int = 0
    """Reads the storage itself failed (a damaged LMDB page), reported as misses; see the tier's log."""
    used_bytes: int = 0
    """Bytes occupied now (stored size, after compression)."""
    capacity_bytes: int = 0
    """Capacity in bytes."""
    num_blocks: int = 0
    """Blocks stored now."""

    def as_dict(self) -> dict[str, int]:
        """Plain dict of the counters."""
        return asdict(self)


@dataclass(frozen=True)
class TierEvent:
    """Something a tier did on its own that the tiered store must learn (drained, not called back)."""

    kind: str
    """``"evicted"`` (capacity) or ``"corrupt"`` (failed verification and deleted)."""
    key: bytes
    """The block key."""


class Tier(ABC):
    """A key-addressed block store below the GPU."""

    name: str = "tier"
    reports_evictions: bool = True
    """Whether the tier announces every block it drops on its own as an event. A tier that cannot
    (a remote daemon) sets ``False``, and the tiered store asks it at lookup instead of mirroring it."""
    takes_victim_hook: bool = False
    """Whether :meth:`set_victim_hook` is supported (the tiers that evict inside their ``put``: LMDB, file, slab)."""
    shared: bool = False
    """Whether other processes read what this tier holds (a daemon): a store writes its blocks through to such
    a tier under every write policy, so another engine finds a prefix as soon as it is committed."""
    max_put_blocks: int | None = 1
    """Most blocks the spiller hands one :meth:`put` (``None``: any number; the tier cuts a batch to what it takes).
    A put evicts older blocks to make room but never blocks of its own batch, so a batch near a tier's capacity
    would be refused in part, or overshoot it, where block after block each put evicted the ones before: a tier
    that does not bound its batches below its capacity keeps one block per put."""
    probes_by_chain: bool = False
    """Whether a lookup must ask :meth:`probe` with the chain from position 0 rather than :meth:`contains_prefix`
    with the keys past its own hit: a tier that places blocks by chain position (the remote tier's groups,
    a daemon with a remote tier)."""

    served_as: tuple[str, ...] = ()
    """The names of the tiers behind this one, when it fronts others (a daemon's: ``daemon:host``,
    ``daemon:disk``, ``daemon:remote``): a store reports a block found here by the one that holds it
    (:meth:`locate_prefix`). Empty: by the store's own name for this tier."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._stats = TierStats()
        self._events: deque[TierEvent] = deque(maxlen=MAX_QUEUED_EVENTS)
        self._events_lock = threading.Lock()
        self._record_events = True
        self.events_dropped = 0
        """Events discarded because the queue was full (nobody drained it in time)."""

    # -------------------------------------------------------------- queries
    @abstractmethod
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, consecutively from the first, are stored. Changes nothing.

        (SGLang's ``batch_exists``: the chained keys of a prompt stop being
        useful at the first gap.)
        """

    def probe(self, chain: Sequence[bytes], start: int = 0) -> int:
        """How many blocks of ``chain`` (keys from position 0), from position 0, are stored, given the first
        ``start`` are held elsewhere: ``start`` plus :meth:`contains_prefix` of the rest here. Changes nothing."""
        return start + self.contains_prefix(chain[start:])

    def locate_prefix(self, keys: Sequence[bytes]) -> Located:
        """:meth:`contains_prefix`, saying where: the blocks found from the first, as runs by which of
        :attr:`served_as` holds them (here: one run, ``None``, the tier itself). Changes nothing."""
        n = self.contains_prefix(keys)
        return ((None, n),) if n else ()

    def locate_chain(self, chain: Sequence[bytes], start: int = 0) -> Located:
        """:meth:`probe`, saying where: the blocks found past the first ``start``, as runs like
        :meth:`locate_prefix`. Changes nothing."""
        n = self.probe(chain, start) - start
        return ((None, n),) if n > 0 else ()

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored. Changes nothing."""

    def used_bytes(self) -> int:
        """Bytes this tier's blocks occupy now (from :meth:`stats`; a tier with a running count overrides it
        to answer without waiting for its writes)."""
        return self.stats().used_bytes

    def keys(self) -> list[bytes]:
        """Every key stored now, a snapshot (for a full report of what this tier holds). Changes nothing.

        Raises :class:`~kvstore.errors.TierError` for a tier that cannot list its keys (a remote store
        shared with others, a daemon seen through its client)."""
        raise TierError(f"the {self.name} tier cannot list its keys")

    # ---------------------------------------------------------------- data
    @abstractmethod
    def get(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        """Copy each found block into its destination; ``result[i]`` says whether ``dests[i]`` was filled.

        Marks found keys as recently used, the last key first: callers pass
        a prefix chain in order, so its first blocks (which every extension
        of the prompt needs) end up the most recent and a tier under
        pressure drops the tail of a prefix before its head. A stored value that fails
        verification is deleted, counted in ``corrupt_dropped``, reported as
        ``False`` and announced as a ``"corrupt"`` event; its destination is
        left with unspecified bytes and must not be used.
        """

    @abstractmethod
    def put(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        """Store blocks; ``result[i]`` is ``True`` if ``keys[i]`` is stored after the call.

        Keys already present are left untouched (content addressing) but
        count as used. Like :meth:`get`, recency is updated last key first.
        May evict least recently used blocks to stay under capacity (each
        announced as an ``"evicted"`` event). ``False`` means the tier could
        not make room (for example every slot is locked).
        """

    def seed_uses(self, keys: Sequence[bytes], uses: Sequence[int]) -> None:
        """Tell the tier how often each stored key was used before it entered this tier.

        A tier whose eviction order counts uses (GDSF, a duel) restarts
        those keys' counts at ``uses`` (a placement policy's ``carry_uses``: the count lives
        in the block's index entry and follows it across tiers); absent keys
        are skipped. This base tier keeps no counts: nothing changes.
        """

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove these keys if present; returns how many were removed."""

    def flush(self) -> None:
        """Make every acknowledged ``put`` durable (no-op for volatile tiers)."""

    def close(self) -> None:
        """Flush and release resources; the tier is unusable afterwards."""

    def set_victim_hook(self, hook: VictimHook | None) -> None:
        """Call ``hook`` before every capacity eviction from now on (``None``: stop). A callback, not an event:
        an event is drained after the victims' bytes are gone, and the remote tier's ``write_back`` needs
        them. ``NotImplementedError`` unless :attr:`takes_victim_hook`."""
        raise NotImplementedError(f"the {self.name} tier has no victim hook")

    # --------------------------------------------------------------- async
    def get_async(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> Future[list[bool]]:
        """:meth:`get` on the tier's I/O threads (default: run inline and return a done future)."""
        return _done_future(lambda: self.get(keys, dests))

    def put_async(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> Future[list[bool]]:
        """:meth:`put` on the tier's I/O threads (default: run inline and return a done future)."""
        return _done_future(lambda: self.put(keys, srcs))

    # ------------------------------------------------------- stats, events
    def stats(self) -> TierStats:
        """A snapshot copy of this tier's counters."""
        return TierStats(**self._stats.as_dict())

    def drain_events(self) -> list[TierEvent]:
        """Return and clear the events queued since the last drain (at most :data:`MAX_QUEUED_EVENTS`)."""
        with self._events_lock:
            events = list(self._events)
            self._events.clear()
        return events

    @property
    def events_queued(self) -> int:
        """Events waiting to be drained. Changes nothing."""
        with self._events_lock:
            return len(self._events)

    def record_events(self, on: bool) -> None:
        """Start or stop queueing events; turning it off also drops the queued ones.

        An owner that never drains (the daemon, whose clients keep their own index) turns them
        off, so eviction does not cost memory or time.
        """
        with self._events_lock:
            self._record_events = on
            if not on:
                self._events.clear()

    def _emit(self, kind: str, key: bytes) -> None:
        self._emit_many(kind, (key,))

    def _emit_many(self, kind: str, keys: Sequence[bytes]) -> None:
        """Queue one ``kind`` event per key (under one lock); the oldest are dropped, and counted, past the bound."""
        if not keys:
            return
        with self._events_lock:
            if not self._record_events:
                return
            events = self._events
            assert events.maxlen is not None
            self.events_dropped += max(0, len(events) + len(keys) - events.maxlen)
            events.extend(TierEvent(kind, key) for key in keys)


class PooledTier(Tier):
    """A tier whose ``get_async``/``put_async`` run :meth:`get`/:meth:`put` on its own thread pool ``_pool``
    (created by the subclass, shut down by its ``close``)."""

    _pool: ThreadPoolExecutor

    def get_async(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> Future[list[bool]]:
        """:meth:`get` on the tier's I/O threads."""
        return self._pool.submit(self.get, keys, dests)

    def put_async(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> Future[list[bool]]:
        """:meth:`put` on the tier's I/O threads (the sources must stay unchanged until the future is done)."""
        return self._pool.submit(self.put, keys, srcs)


def check_buffers(keys: Sequence[bytes], bufs: Sequence[Buffer], nbytes: int, tier: str) -> None:
    """Raise ``ValueError`` naming the block unless every buffer is a contiguous ``uint8[nbytes]`` CPU tensor."""
    buffer_addresses(keys, bufs, nbytes, tier)


def buffer_addresses(keys: Sequence[bytes], bufs: Sequence[Buffer], nbytes: int, tier: str) -> list[int]:
    """:func:`check_buffers`, returning each buffer's data address (valid while the caller holds ``bufs``).

    One pass with the cheapest tensor attributes: at 64 KiB blocks the per-block
    Python here is a visible share of a host-tier copy.
    """
    if len(keys) != len(bufs):
        raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
    u8 = torch.uint8
    out: list[int] = []
    for key, buf in zip(keys, bufs):
        if buf.dtype is not u8 or buf.numel() != nbytes or not buf.is_cpu or not buf.is_contiguous():
            raise ValueError(
                f"buffer for {tier} block {key[:8].hex()}… is {buf.dtype}[{buf.numel()}] on {buf.device}"
                f" (contiguous={buf.is_contiguous()}), expected contiguous uint8[{nbytes}] on cpu"
            )
        out.append(buf.data_ptr())
    return out


def _done_future(fn: Callable[[], list[bool]]) -> Future[list[bool]]:
    fut: Future[list[bool]] = Future()
    try:
        fut.set_result(fn())
    except BaseException as exc:  # the future carries it to the caller
        fut.set_exception(exc)
    return fut


@dataclass
class TierRegistry:
    """Tier classes by the name used in YAML."""

    factories: dict[str, Callable[..., Tier]] = field(default_factory=dict)

    def register(self, name: str, factory: Callable[..., Tier]) -> None:
        """Make ``factory`` available as ``name``; a name can be registered once."""
        if name in self.factories:
            raise ValueError(f"tier {name!r} is already registered")
        self.factories[name] = factory

    def create(self, name: str, *args: object, **kwargs: object) -> Tier:
        """Build the tier registered as ``name``."""
        try:
            factory = self.factories[name]
        except KeyError:
            raise ValueError(f"unknown tier {name!r}; known tiers: {', '.join(sorted(self.factories))}") from None
        return factory(*args, **kwargs)
