"""The radix index's records: a cached block (:class:`BlockEntry`), a run of blocks
(:class:`RadixNode`), and the small frozen results of a match or an insert."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class BlockEntry:
    """One cached block and its residency. Only :mod:`kvstore.placement` changes the residency fields."""

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


@dataclass(eq=False)
class RadixNode:
    """A run of blocks without branches. ``pin_count`` > 0 protects it from eviction."""

    entries: list[BlockEntry]
    parent: RadixNode | None
    children: dict[bytes, RadixNode] = field(default_factory=dict)
    pin_count: int = 0
    """Requests pinning this node or a descendant (see :meth:`RadixIndex.pin`)."""
    last_access: int = 0
    tokens: list[int] | None = None
    """The node's tokens (``len(entries) * block_size``), or ``None`` when inserted by keys only."""
    tok_children: dict[tuple, RadixNode] = field(default_factory=dict)
    """Children with tokens, by :attr:`tok_key`."""
    tok_key: tuple | None = None
    """Key of this node in its parent's ``tok_children``: its first block's tokens
    (prefixed by the tenant's root key at the top level); ``None`` without tokens."""

    @property
    def is_leaf(self) -> bool:
        """No children."""
        return not self.children


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

    entries: tuple[BlockEntry, ...]
    """One entry per inserted key, in order (existing entries for keys already present)."""
    num_existing: int
    """How many leading keys were already in the index (their residency was left unchanged)."""
    node: RadixNode
    """The node holding the last key."""
