"""The radix index's records: a cached block (:class:`BlockEntry`), a run of blocks
(:class:`RadixNode`), and the small frozen results of a match or an insert."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat


@dataclass(eq=False, slots=True)
class BlockEntry:
    """One cached block and its residency. Only :mod:`kvstore.store.placement` changes the residency fields."""

    key: bytes
    gpu_block: int | None = None
    node: RadixNode | None = field(default=None, repr=False)
    """The index node holding the block (``None`` once removed). Third, so that a commit's entries are made
    from three arguments (key, GPU block, node) and the rest left at their defaults: fewer per call."""
    host_slot: int | None = None
    on_disk: bool = False
    hits: int = 0
    """Times a lookup matched this block (drives ``write_through_selective``)."""

    @property
    def tier(self) -> str | None:
        """The fastest tier holding the block: ``"gpu"``, ``"host"``, ``"disk"`` or ``None``."""
        if self.gpu_block is not None:
            return "gpu"
        if self.host_slot is not None:
            return "host"
        if self.on_disk:
            return "disk"
        return None


EntriesMade = Callable[["RadixNode", list[BlockEntry], Sequence[bytes], list[int]], None]
"""Told when a node's deferred entries are made, so the maps that recorded the node in their place can
record the entries instead (see :attr:`RadixNode.entries`)."""


class RadixNode:
    """A run of blocks without branches. ``pin_count`` > 0 protects it from eviction.

    A commit's run may be made *deferred*: the node keeps the run's keys and GPU blocks, and its
    :class:`BlockEntry` objects are made on the first read of :attr:`entries`. Why: one Python object per
    block (and the collector passes 8192 new objects set off) was most of a commit's time; a commit
    followed by the caller's ``free`` needs no entry at all (the key map and the GPU block map record
    the node until then). A deferred run's blocks live on the GPU only, with no hits; the node's pins,
    access time and tokens are kept as for any node. Whatever reads or changes one block's entry reads
    :attr:`entries` first, which makes them all and tells the owner of those maps (:data:`EntriesMade`),
    so a block's state is never in two places. Read :attr:`entries` under the store's lock: making
    them changes those maps.
    """

    __slots__ = ("_entries", "_deferred", "parent", "children", "pin_count", "last_access", "tokens",
                 "tok_children", "tok_key")

    def __init__(self, entries: list[BlockEntry], parent: RadixNode | None, pin_count: int = 0,
                 last_access: int = 0) -> None:
        self._entries: list[BlockEntry] | None = entries
        self._deferred: tuple[Sequence[bytes], list[int], EntriesMade] | None = None
        """Keys, GPU blocks and the maps' owner of a run whose entries are not made yet (``_entries`` is ``None``)."""
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.pin_count = pin_count
        """Requests pinning this node or a descendant (see :meth:`RadixIndex.pin`)."""
        self.last_access = last_access
        self.tokens: list[int] | None = None
        """The node's tokens (``len(entries) * block_size``), or ``None`` when inserted by keys only."""
        self.tok_children: dict[tuple, RadixNode] = {}
        """Children with tokens, by :attr:`tok_key`."""
        self.tok_key: tuple | None = None
        """Key of this node in its parent's ``tok_children``: its first block's tokens
        (prefixed by the tenant's root key at the top level); ``None`` without tokens."""

    @classmethod
    def deferred(cls, keys: Sequence[bytes], gpu: list[int], parent: RadixNode, last_access: int,
                 made: EntriesMade) -> RadixNode:
        """A node for a run of GPU-only blocks whose entries are made on first read (``gpu[i]`` holds ``keys[i]``;
        both are kept, not copied). ``made`` is called once, with the node, its new entries, ``keys`` and ``gpu``."""
        node = cls([], parent, last_access=last_access)
        node._entries = None
        node._deferred = (keys, gpu, made)
        return node

    @property
    def entries(self) -> list[BlockEntry]:
        """The run's entries, in order (made now if deferred, and ``made`` told)."""
        es = self._entries
        if es is None:
            assert self._deferred is not None
            keys, gpu, made = self._deferred
            es = self._entries = list(map(BlockEntry, keys, gpu, repeat(self)))
            self._deferred = None
            made(self, es, keys, gpu)
        return es

    @entries.setter
    def entries(self, value: list[BlockEntry]) -> None:
        if self._entries is None:
            raise RuntimeError("a deferred node's entries are replaced only after they are made")
        self._entries = value

    @property
    def is_deferred(self) -> bool:
        """Whether the entries are still to be made. Changes nothing."""
        return self._entries is None

    def deferred_keys(self) -> Sequence[bytes] | None:
        """The run's keys while its entries are deferred, else ``None``. Changes nothing."""
        return self._deferred[0] if self._deferred is not None else None

    def drop_deferred(self) -> None:
        """Forget a deferred run without making its entries (its node has left the index): it has none now."""
        assert self._deferred is not None and self.parent is None
        self._deferred = None
        self._entries = []

    @property
    def num_blocks(self) -> int:
        """Blocks in the run (makes no entries)."""
        es = self._entries
        if es is None:
            assert self._deferred is not None
            return len(self._deferred[0])
        return len(es)

    @property
    def is_leaf(self) -> bool:
        """No children."""
        return not self.children

    def subtree(self) -> list[RadixNode]:
        """This node and every node below it, each before its children. Changes nothing."""
        out, stack = [], [self]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out


@dataclass(frozen=True)
class RadixMatch:
    """Result of :meth:`RadixIndex.match`: the longest cached prefix and its split by tier."""

    entries: tuple[BlockEntry, ...]
    """Matched blocks in order (each names its residency)."""
    node: RadixNode
    """Deepest node touched by the match (the root when nothing matched); pin it to protect the prefix."""
    gpu_blocks: int
    host_blocks: int
    disk_blocks: int
    tiers: tuple[str, ...] = ()
    """The fastest tier of each matched block (``"gpu"``, ``"host"`` or ``"disk"``), in order."""

    @property
    def num_blocks(self) -> int:
        """Matched full blocks."""
        return len(self.entries)


@dataclass(frozen=True)
class InsertResult:
    """Result of :meth:`RadixIndex.insert`."""

    existing: tuple[BlockEntry, ...]
    """The entries of the leading keys already indexed (their residency was left unchanged)."""
    node: RadixNode
    """The node holding the last key."""
    leaf: RadixNode | None = None
    """The new leaf holding the new keys, ``None`` when every key was indexed already. Its entries may be
    deferred (see :class:`RadixNode`): :attr:`new_entries` makes them."""

    @property
    def num_existing(self) -> int:
        """How many leading keys were already in the index."""
        return len(self.existing)

    @property
    def num_new(self) -> int:
        """How many keys were indexed by this insert (makes no entries)."""
        return self.leaf.num_blocks if self.leaf is not None else 0

    @property
    def new_entries(self) -> list[BlockEntry]:
        """The new keys' entries, in order (makes a deferred leaf's entries: call under the store's lock)."""
        return self.leaf.entries if self.leaf is not None else []

    @property
    def entries(self) -> tuple[BlockEntry, ...]:
        """One entry per inserted key, in order (existing entries for keys already present; see :attr:`new_entries`)."""
        return self.existing + tuple(self.new_entries)
