"""Radix prefix index: which block sequences are cached, and in which tier.

A compressed trie over block-aligned token sequences, keyed by *block keys*
(see :mod:`kvstore.hashing`) instead of raw tokens. A chained key names its
whole prefix (and the model layout and tenant salt), so comparing keys is
comparing prefixes, and two tenants can never meet in the tree::

    root
     └─ node [k0 k1 k2]          one node = a run of blocks with no branch
          ├─ node [k3 k4]        children are keyed by their first block key
          └─ node [k3' k4' k5']  (diverged at block 3: the node was split)

Each block is a :class:`BlockEntry` recording where it lives now: a GPU
block id, a host slot, on disk. Invariants (checked by
:meth:`RadixIndex.check_integrity`): every entry lives in at least one tier,
no GPU block or host slot is recorded twice, every locked node's ancestors
are locked at least as often as their locked children together. (A block of a
*locked* node may briefly live nowhere, when a lower tier dropped its last
copy while a request held the node; a match stops there, and the store removes
it once the node is unlocked.)

LRU uses a logical clock (an int bumped on every touch), so eviction order is
exact and deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvstore.errors import BlockStateError, IntegrityError
from kvstore.hashing import Salt, block_keys
from kvstore.layout import KVLayout


@dataclass(eq=False)
class BlockEntry:
    """One cached block and its residency. Mutate it only through :class:`RadixIndex` setters."""

    key: bytes
    gpu_block: int | None = None
    host_slot: int | None = None
    on_disk: bool = False
    hits: int = 0
    """Times a lookup matched this block (drives ``write_through_selective``)."""
    node: RadixNode | None = field(default=None, repr=False)

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
    """A run of blocks without branches. ``lock_ref`` > 0 protects it from eviction."""

    entries: list[BlockEntry]
    parent: RadixNode | None
    children: dict[bytes, RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

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
    """Deepest node touched by the match (the root when nothing matched); lock it to protect the prefix."""
    gpu_blocks: int
    host_blocks: int
    disk_blocks: int

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


class RadixIndex:
    """The prefix index. Not thread-safe: the tiered store serialises access."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.root = RadixNode(entries=[], parent=None)
        self._clock = 0
        self._by_key: dict[bytes, BlockEntry] = {}

    # ---------------------------------------------------------------- lookup
    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: bytes) -> BlockEntry | None:
        """The entry of ``key`` if indexed. Changes nothing."""
        return self._by_key.get(key)

    def keys_for(self, tokens: Sequence[int], salt: Salt = None) -> list[bytes]:
        """Block keys of ``tokens`` under this index's layout."""
        return block_keys(tokens, self.layout, salt)

    def match(self, tokens: Sequence[int], salt: Salt = None) -> RadixMatch:
        """Longest cached prefix of ``tokens`` (full blocks only); see :meth:`match_keys`."""
        return self.match_keys(self.keys_for(tokens, salt))

    def match_keys(self, keys: Sequence[bytes], count_hits: bool = True) -> RadixMatch:
        """Longest cached prefix of a key chain.

        Changes nothing but access times: every node on the matched path
        becomes most recently used and (when ``count_hits``) each matched
        entry's ``hits`` grows by one. Nodes are never split by a match.
        """
        self._clock += 1
        node = self.root
        node.last_access = self._clock
        matched: list[BlockEntry] = []
        i = 0
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                break
            child.last_access = self._clock
            k = 0
            while (
                k < len(child.entries)
                and i + k < len(keys)
                and child.entries[k].key == keys[i + k]
                and child.entries[k].tier is not None  # a block pending removal ends the prefix
            ):
                k += 1
            matched.extend(child.entries[:k])
            node = child
            i += k
            if k < len(child.entries):
                break
        if count_hits:
            for e in matched:
                e.hits += 1
        tiers = [e.tier for e in matched]
        return RadixMatch(tuple(matched), node, tiers.count("gpu"), tiers.count("host"), tiers.count("disk"))

    # ---------------------------------------------------------------- insert
    def insert(
        self,
        keys: Sequence[bytes],
        gpu_blocks: Sequence[int | None] | None = None,
        host_slots: Sequence[int | None] | None = None,
        on_disk: Sequence[bool] | None = None,
    ) -> InsertResult:
        """Add a key chain (from the root) with the residency of each new block.

        Keys already present keep their entries unchanged (the caller frees any
        duplicate GPU block it holds). Splits a node where the chain diverges
        inside it. Every new entry must live in at least one tier.
        """
        n = len(keys)
        gpu = list(gpu_blocks) if gpu_blocks is not None else [None] * n
        host = list(host_slots) if host_slots is not None else [None] * n
        disk = list(on_disk) if on_disk is not None else [False] * n
        if not (len(gpu) == len(host) == len(disk) == n):
            raise ValueError("insert: keys and residency lists differ in length")
        self._clock += 1
        node, i = self.root, 0
        out: list[BlockEntry] = []
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            k = 0
            while k < len(child.entries) and i + k < n and child.entries[k].key == keys[i + k]:
                k += 1
            if k < len(child.entries):
                if i + k == n:  # the chain ends inside this node: nothing to add, no split
                    child.last_access = self._clock
                    out.extend(child.entries[:k])
                    node, i = child, n
                    break
                child = self._split(child, k)
            child.last_access = self._clock
            out.extend(child.entries)
            node, i = child, i + k
        num_existing = i
        if i < n:
            new_entries = []
            for j in range(i, n):
                if keys[j] in self._by_key:
                    raise IntegrityError(f"key {keys[j].hex()[:16]} already indexed under another prefix")
                e = BlockEntry(keys[j], gpu[j], host[j], bool(disk[j]))
                if e.tier is None:
                    raise ValueError(f"insert: block {keys[j].hex()[:16]} must live in at least one tier")
                new_entries.append(e)
            leaf = RadixNode(entries=new_entries, parent=node, last_access=self._clock)
            for e in new_entries:
                e.node = leaf
                self._by_key[e.key] = e
            node.children[new_entries[0].key] = leaf
            out.extend(new_entries)
            node = leaf
        return InsertResult(tuple(out), num_existing, node)

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Split ``node`` after its first ``k`` entries; returns the new upper node."""
        assert 0 < k < len(node.entries)
        parent = node.parent
        assert parent is not None
        upper = RadixNode(entries=node.entries[:k], parent=parent, lock_ref=node.lock_ref, last_access=node.last_access)
        node.entries = node.entries[k:]
        parent.children[upper.entries[0].key] = upper
        upper.children[node.entries[0].key] = node
        node.parent = upper
        for e in upper.entries:
            e.node = upper
        return upper

    # ----------------------------------------------------------------- locks
    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and all its ancestors from eviction (counted)."""
        n: RadixNode | None = node
        while n is not None:
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one :meth:`lock` of ``node``."""
        n: RadixNode | None = node
        chain = []
        while n is not None:
            if n.lock_ref <= 0:
                raise BlockStateError("unlock of a node that is not locked")
            chain.append(n)
            n = n.parent
        for n in chain:
            n.lock_ref -= 1

    # ------------------------------------------------------------- residency
    def set_gpu(self, entry: BlockEntry, block: int | None) -> None:
        """Record (or clear, with ``None``) the GPU block holding ``entry``."""
        entry.gpu_block = block

    def set_host(self, entry: BlockEntry, slot: int | None) -> None:
        """Record (or clear) the host slot holding ``entry``."""
        entry.host_slot = slot

    def set_disk(self, entry: BlockEntry, present: bool) -> None:
        """Record whether ``entry`` is on disk."""
        entry.on_disk = present

    # -------------------------------------------------------------- eviction
    @staticmethod
    def depth(node: RadixNode) -> int:
        """Number of ancestors of ``node`` (the root has depth 0)."""
        d = 0
        n = node.parent
        while n is not None:
            d += 1
            n = n.parent
        return d

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def lru_nodes(self, eligible: Callable[[RadixNode], bool]) -> list[RadixNode]:
        """Unlocked nodes satisfying ``eligible``, least recently used first. Changes nothing.

        The store uses it for tier-aware eviction (for example "holds GPU
        blocks and no descendant does").
        """
        found = [n for n in self.nodes() if n.lock_ref == 0 and eligible(n)]
        # Ties (a path touched by one match) go deepest first, so a prefix outlives its extensions.
        found.sort(key=lambda n: (n.last_access, -self.depth(n)))
        return found

    def evict_lru_leaf(self) -> RadixNode | None:
        """Remove the least recently used unlocked leaf; returns it (its entries say what to free).

        Returns ``None`` when every leaf is locked or the index is empty.
        """
        leaves = self.lru_nodes(lambda n: n.is_leaf)
        if not leaves:
            return None
        victim = leaves[0]
        self.remove_leaf(victim)
        return victim

    def remove_leaf(self, node: RadixNode) -> None:
        """Delete an unlocked leaf and its entries from the index."""
        if node is self.root or node.children or node.lock_ref:
            raise BlockStateError("only an unlocked leaf can be removed")
        assert node.parent is not None
        del node.parent.children[node.entries[0].key]
        for e in node.entries:
            del self._by_key[e.key]
            e.node = None
        node.parent = None

    def remove_tail(self, node: RadixNode, keep: int) -> list[BlockEntry]:
        """Drop the entries of a leaf after its first ``keep``; returns them (the leaf goes when ``keep`` is 0)."""
        if node.children or node.lock_ref:
            raise BlockStateError("only an unlocked leaf can be truncated")
        if keep <= 0:
            dropped = list(node.entries)
            self.remove_leaf(node)
            return dropped
        dropped = node.entries[keep:]
        node.entries = node.entries[:keep]
        for e in dropped:
            del self._by_key[e.key]
            e.node = None
        return dropped

    # ------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` if any invariant of the index is broken."""
        seen_gpu: dict[int, bytes] = {}
        seen_host: dict[int, bytes] = {}
        count = 0
        if self.root.entries or self.root.parent is not None:
            raise IntegrityError("root must have no entries and no parent")
        for node in self.nodes():
            if not node.entries:
                raise IntegrityError("empty non-root node")
            if node.parent is None or node.parent.children.get(node.entries[0].key) is not node:
                raise IntegrityError("node not registered under its parent by its first key")
            if node.lock_ref < sum(c.lock_ref for c in node.children.values()):
                raise IntegrityError("a node is locked less than its locked children")
            if node.lock_ref < 0:
                raise IntegrityError("negative lock count")
            for e in node.entries:
                count += 1
                if e.node is not node or self._by_key.get(e.key) is not e:
                    raise IntegrityError(f"entry {e.key.hex()[:16]} not indexed consistently")
                if e.tier is None and node.lock_ref == 0:
                    # Only a locked node may hold a block that lost its last copy (removed once unlocked).
                    raise IntegrityError(f"entry {e.key.hex()[:16]} lives in no tier")
                if e.gpu_block is not None:
                    if e.gpu_block in seen_gpu:
                        raise IntegrityError(f"GPU block {e.gpu_block} recorded twice")
                    seen_gpu[e.gpu_block] = e.key
                if e.host_slot is not None:
                    if e.host_slot in seen_host:
                        raise IntegrityError(f"host slot {e.host_slot} recorded twice")
                    seen_host[e.host_slot] = e.key
        if count != len(self._by_key):
            raise IntegrityError(f"{count} entries in the tree but {len(self._by_key)} indexed by key")
