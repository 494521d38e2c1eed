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
:meth:`RadixIndex.check_integrity`, in :mod:`kvstore.store.radix_check`): every
entry lives in at least one tier, no GPU block or host slot is recorded
twice, every pinned node's ancestors are pinned at least as often as their
pinned children together. (A block of a *pinned* node may briefly live
nowhere, when a lower tier dropped its last copy while a request held the
node; a match stops there, and the store removes it once the node is
unpinned.) The tiered store changes residency only
through :mod:`kvstore.store.placement`.

A commit's run of GPU-only blocks is *deferred*: its node keeps the run's keys
and GPU blocks and makes the entries on the first read of ``node.entries``
(see :class:`RadixNode`); until then the key map records the node for each
of its keys, and :meth:`get` makes the entries when asked for one.

Nodes also keep their tokens when the caller gives them (the store always
does), so :meth:`RadixIndex.match` can walk the tree by token comparison, as
SGLang's radix cache does, and a prompt whose prefix is cached costs no
hashing at all; keys are computed only for the part beyond the match. The
top level is keyed by ``(root key, first block)``, so the token walk keeps
tenants (salts) and models apart exactly as the keys do.

Each node records its last access on a logical clock (an int bumped on every
match or insert), exact and deterministic. The index chooses no victims:
GPU eviction order is kept by :class:`kvstore.policy.gpu_lru.GpuLru` in O(1), and
the lower tiers keep their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain, repeat
from operator import attrgetter

from kvstore.errors import BlockStateError, IntegrityError
from kvstore.hashing import Salt, block_keys, root_key
from kvstore.layout import KVLayout
from kvstore.store.radix_check import check_index
from kvstore.store.radix_node import BlockEntry, InsertResult, RadixMatch, RadixNode

__all__ = ["BlockEntry", "InsertResult", "RadixIndex", "RadixMatch", "RadixNode"]

_GPU_BLOCK = attrgetter("gpu_block")


def _as_list(tokens: Sequence[int]) -> list[int]:
    """``tokens`` as a list: a list itself (read, never changed), else a copy (``tolist`` for numpy)."""
    if isinstance(tokens, list):
        return tokens
    return tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)


class RadixIndex:
    """The prefix index. Not thread-safe: the tiered store serialises access."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.root = RadixNode(entries=[], parent=None)
        self._clock = 0
        self._by_key: dict[bytes, BlockEntry | RadixNode] = {}
        """Key -> its entry, or the node of a deferred run holding it (until the run's entries are made)."""
        self.on_entries_made: Callable[[list[BlockEntry], list[int]], None] | None = None
        """Told when a deferred run's entries are made (the store's placement re-records its GPU blocks)."""
        self._roots: dict[bytes, bytes] = {}  # salt bytes -> root key (pure, cached)

    # ---------------------------------------------------------------- lookup
    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: bytes) -> BlockEntry | None:
        """The entry of ``key`` if indexed. Changes nothing (but makes a deferred run's entries)."""
        v = self._by_key.get(key)
        if type(v) is RadixNode:
            v.entries  # noqa: B018  # makes them; _entries_made records them here
            v = self._by_key[key]
        return v  # type: ignore[return-value]  # a node was replaced by its entries just above

    def _entries_made(self, node: RadixNode, entries: list[BlockEntry], keys: Sequence[bytes], gpu: list[int]) -> None:
        """A deferred run's entries were just made (``keys[i]``, GPU block ``gpu[i]``): record them in place of
        their node (every key of the run still names it: nothing changes a deferred run's blocks)."""
        self._by_key.update(zip(keys, entries))
        if self.on_entries_made is not None:
            self.on_entries_made(entries, gpu)

    def keys_for(self, tokens: Sequence[int], salt: Salt = None) -> list[bytes]:
        """Block keys of ``tokens`` under this index's layout."""
        return block_keys(tokens, self.layout, salt)

    def root_key(self, salt: Salt = None) -> bytes:
        """The chain root of ``salt`` under this layout (cached)."""
        sb = salt.encode() if isinstance(salt, str) else (b"" if salt is None else bytes(salt))
        key = self._roots.get(sb)
        if key is None:
            key = self._roots[sb] = root_key(self.layout, salt)
        return key

    def match(self, tokens: Sequence[int], salt: Salt = None, count_hits: bool = True) -> RadixMatch:
        """Longest cached prefix of ``tokens`` (full blocks only), found by comparing tokens.

        No hashing. Follows only nodes inserted with tokens; :meth:`match_keys`
        finds the same prefix from keys. Changes nothing but access times and
        (when ``count_hits``) hit counts, like :meth:`match_keys`. A ``list``
        is read in place (not copied).
        """
        toks = _as_list(tokens)
        bs = self.layout.block_size
        n_full = len(toks) // bs
        node = self.root
        matched: list[BlockEntry] = []
        i = 0  # matched blocks
        child = self.root.tok_children.get((self.root_key(salt), *toks[:bs])) if n_full else None
        while child is not None:
            nb = len(child.entries)
            lo = i * bs
            assert child.tokens is not None
            if i + nb <= n_full and toks[lo : lo + nb * bs] == child.tokens:
                k = nb
            else:
                k = 1  # the first block matched: it is the child's key
                ctoks = child.tokens
                while k < nb and i + k < n_full and toks[lo + k * bs : lo + (k + 1) * bs] == ctoks[k * bs : (k + 1) * bs]:
                    k += 1
            matched += child.entries[:k] if k < nb else child.entries
            node = child
            i += k
            if k < nb or i >= n_full:
                break
            child = node.tok_children.get(tuple(toks[i * bs : (i + 1) * bs]))
        return self._finish_match(matched, node, count_hits)

    def match_keys(self, keys: Sequence[bytes], count_hits: bool = True) -> RadixMatch:
        """Longest cached prefix of a key chain (dictionary lookups; a chained key implies its prefix).

        ``keys`` is a chain from the root (as :func:`~kvstore.hashing.block_keys` makes it), so only a
        bisection's probes are needed; a list that is visibly no such chain is probed key by key.
        Changes nothing but access times: every node on the matched path
        becomes most recently used and (when ``count_hits``) each matched
        entry's ``hits`` grows by one. Nodes are never split by a match.
        """
        by_key = self._by_key
        # A chained key names its whole prefix, and the tree holds every indexed block's prefix, so the
        # indexed keys of a chain are a prefix of it: bisect for its end (13 probes for 8192 blocks), then
        # read the entries off the tree path (list joins in C) instead of probing every key.
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi) // 2
            if keys[mid] in by_key:
                lo = mid + 1
            else:
                hi = mid
        last = by_key[keys[lo - 1]] if lo else None
        if type(last) is RadixNode:  # a deferred run: make its entries
            last = self.get(keys[lo - 1])
        matched = self._path_entries(last, lo) if last is not None else []  # type: ignore[arg-type]
        if matched is None or (matched and by_key.get(keys[0]) is not matched[0]):  # the path's entries are made
            matched = self._scan_keys(keys)  # not a chain from the root: the longest run of indexed keys
        node = matched[-1].node if matched else self.root
        assert node is not None
        return self._finish_match(matched, node, count_hits)

    def _path_entries(self, entry: BlockEntry, n: int) -> list[BlockEntry] | None:
        """The ``n`` entries of the tree path from the root through ``entry``; ``None`` unless ``entry`` is
        the ``n``-th block of its chain. Changes nothing."""
        node = entry.node
        assert node is not None
        runs: list[list[BlockEntry]] = []
        depth = 0
        p = node.parent
        while p is not None and p is not self.root:
            runs.append(p.entries)
            depth += len(p.entries)
            p = p.parent
        k = n - depth
        if not (0 < k <= len(node.entries)) or node.entries[k - 1] is not entry:
            return None
        runs.reverse()
        runs.append(node.entries[:k] if k < len(node.entries) else node.entries)
        return list(chain.from_iterable(runs)) if len(runs) > 1 else list(runs[0])

    def _scan_keys(self, keys: Sequence[bytes]) -> list[BlockEntry]:
        """The entries of the leading indexed keys, probing every key (any key list). Changes nothing."""
        found = list(map(self._by_key.get, keys))  # in C; the probes past a miss cost less than a Python loop
        if RadixNode in map(type, found):  # deferred runs: make their entries, then probe again
            for v in {id(v): v for v in found if type(v) is RadixNode}.values():
                v.entries  # noqa: B018  # makes them; _entries_made records them here
            found = list(map(self._by_key.get, keys))
        try:
            return found[: found.index(None)]  # type: ignore[return-value]
        except ValueError:
            return found  # type: ignore[return-value]

    def _finish_match(self, matched: list[BlockEntry], node: RadixNode, count_hits: bool) -> RadixMatch:
        """Cut the match at the first block that lives nowhere (pending removal), touch the path, count by tier."""
        n_off_gpu = 0  # blocks without a GPU copy; the list of GPU blocks is built only when there are any
        gpu: list[int | None] = []
        if None in map(_GPU_BLOCK, matched):  # only then can a block live nowhere; find the first such one
            gpu = list(map(_GPU_BLOCK, matched))
            live = next((j for j, e in enumerate(matched) if e.gpu_block is None and e.tier is None), len(matched))
            if live < len(matched):
                matched, gpu = matched[:live], gpu[:live]
                node = matched[-1].node if matched else self.root  # type: ignore[assignment]
                assert node is not None
            n_off_gpu = gpu.count(None)
        self._clock += 1
        n: RadixNode | None = node
        while n is not None:  # the matched path becomes most recently used
            self._touch(n)
            n = n.parent
        if count_hits:
            for e in matched:
                e.hits += 1
        n_gpu = len(matched) - n_off_gpu
        if not n_off_gpu:
            tiers: tuple[str, ...] = ("gpu",) * n_gpu
            n_host = 0
        else:
            tiers = tuple("gpu" if g is not None else "host" if e.host_slot is not None else "disk"
                          for g, e in zip(gpu, matched))
            n_host = tiers.count("host")
        return RadixMatch(tuple(matched), node, n_gpu, n_host, len(matched) - n_gpu - n_host, tiers)

    # ---------------------------------------------------------------- insert
    def insert(
        self,
        keys: Sequence[bytes],
        gpu_blocks: Sequence[int | None] | None = None,
        host_slots: Sequence[int | None] | None = None,
        on_disk: Sequence[bool] | None = None,
        tokens: Sequence[int] | None = None,
        salt: Salt = None,
    ) -> InsertResult:
        """Add a key chain (from the root) with the residency of each new block.

        Keys already present keep their entries unchanged (the caller frees any
        duplicate GPU block it holds). Splits a node where the chain diverges
        inside it. Every new entry must live in at least one tier.

        ``tokens`` (at least ``len(keys) * block_size``; the keys must be their
        chain under ``salt``) make the new blocks findable by :meth:`match`;
        existing nodes without tokens that the call covers whole adopt them.
        """
        n = len(keys)
        bs = self.layout.block_size
        toks: list[int] | None = None
        if tokens is not None:
            toks = _as_list(tokens)  # read only: every node gets its own slice
            if len(toks) < n * bs:
                raise ValueError(f"insert: {len(toks)} tokens cannot hold {n} blocks of {bs}")
        tenant = self.root_key(salt) if toks is not None else None
        gpu: list[int | None] = list(gpu_blocks) if gpu_blocks is not None else [None] * n
        # Absent host slots and disk flags stay None (no per-block list to build or read: a commit's case).
        host: list[int | None] | None = list(host_slots) if host_slots is not None else None
        disk: list[bool] | None = list(map(bool, on_disk)) if on_disk is not None else None
        if len(gpu) != n or (host is not None and len(host) != n) or (disk is not None and len(disk) != n):
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
                    self._touch(child)
                    out.extend(child.entries[:k])
                    node, i = child, n
                    break
                child = self._split(child, k)
            self._touch(child)
            if toks is not None and child.tokens is None:
                self._set_tokens(child, toks[i * bs : (i + k) * bs], tenant)
            out.extend(child.entries)
            node, i = child, i + k
        leaf: RadixNode | None = None
        if i < n:
            leaf = self._new_leaf(node, keys[i:], gpu[i:], None if host is None else host[i:],
                                  None if disk is None else disk[i:])
            if toks is not None:
                self._set_tokens(leaf, toks[i * bs : n * bs], tenant)
            node = leaf
        return InsertResult(tuple(out), node, leaf)

    def _new_leaf(self, parent: RadixNode, keys: Sequence[bytes], gpu: list[int | None],
                  host: list[int | None] | None, disk: list[bool] | None) -> RadixNode:
        """Index a run of new blocks as one leaf under ``parent``; checks first, changes nothing on error.

        ``host`` / ``disk`` ``None``: no host slots, not on disk. Written as passes in C over the run (a
        commit of a 128k-token prompt is one run of 8192 blocks).
        """
        by_key = self._by_key
        if None in gpu:  # then a block may live nowhere
            for key, g, hs, d in zip(keys, gpu, host or repeat(None), disk or repeat(False)):
                if g is None and hs is None and not d:
                    raise ValueError(f"insert: block {key.hex()[:16]} must live in at least one tier")
        values: Iterable[BlockEntry | RadixNode]
        if host is None and disk is None and None not in gpu:  # a commit: entries made on first read
            leaf = RadixNode.deferred(keys, gpu, parent, self._clock, self._entries_made)  # type: ignore[arg-type]
            values = repeat(leaf)
        else:
            leaf = RadixNode(entries=[], parent=parent, last_access=self._clock)
            leaf.entries = list(map(BlockEntry, keys, gpu, repeat(leaf), host or repeat(None), disk or repeat(False)))
            values = leaf.entries
        before = len(by_key)
        by_key.update(zip(keys, values))
        if len(by_key) != before + len(keys):  # checked after the update (no disjointness pass): undo it
            self._undo_keys(keys, leaf)
            dup = next((k for k in keys if k in by_key), None)
            if dup is not None:
                raise IntegrityError(f"key {dup.hex()[:16]} already indexed under another prefix")
            raise IntegrityError("insert: a key appears twice in one chain")
        parent.children[keys[0]] = leaf
        return leaf

    def _undo_keys(self, keys: Sequence[bytes], leaf: RadixNode) -> None:
        """Take a failed insert's ``leaf`` (not in the tree) back out of the key map and restore the entries it
        replaced (read off the tree, which the failed insert did not change). An error path: O(index)."""
        by_key = self._by_key
        mine = {id(leaf)} if leaf.is_deferred else {id(e) for e in leaf.entries}
        for k in keys:
            if id(by_key.get(k)) in mine:
                del by_key[k]
        for node in self.nodes():
            keys_of = node.deferred_keys()
            if keys_of is not None:  # its keys may have been replaced by the failed leaf's: record the node again
                by_key.update(zip(keys_of, repeat(node)))
                continue
            for e in node.entries:
                by_key.setdefault(e.key, e)

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Split ``node`` after its first ``k`` entries; returns the new upper node."""
        assert 0 < k < len(node.entries)
        parent = node.parent
        assert parent is not None
        upper = RadixNode(entries=node.entries[:k], parent=parent, pin_count=node.pin_count, last_access=node.last_access)
        node.entries = node.entries[k:]
        parent.children[upper.entries[0].key] = upper
        upper.children[node.entries[0].key] = node
        node.parent = upper
        for e in upper.entries:
            e.node = upper
        if node.tokens is not None:
            bs = self.layout.block_size
            upper.tokens, node.tokens = node.tokens[: k * bs], node.tokens[k * bs :]
            upper.tok_key = node.tok_key
            parent.tok_children[upper.tok_key] = upper  # type: ignore[index]
            node.tok_key = tuple(node.tokens[:bs])
            upper.tok_children[node.tok_key] = node
        return upper

    def _set_tokens(self, node: RadixNode, tokens: list[int], tenant: bytes | None) -> None:
        """Give a node its tokens (it keeps this list: pass a fresh slice) and register it for token walks."""
        parent = node.parent
        assert parent is not None
        if parent is not self.root and parent.tokens is None:
            return  # unreachable by a token walk anyway: keep it key-only
        bs = self.layout.block_size
        node.tokens = tokens
        first = tuple(tokens[:bs])
        node.tok_key = (tenant, *first) if parent is self.root else first
        parent.tok_children[node.tok_key] = node

    # ------------------------------------------------------------------ pins
    def pin(self, node: RadixNode) -> None:
        """Protect ``node`` and all its ancestors from eviction (counted). The store pins through its placement."""
        n: RadixNode | None = node
        while n is not None:
            n.pin_count += 1
            n = n.parent

    def unpin(self, node: RadixNode) -> None:
        """Undo one :meth:`pin` of ``node``."""
        n: RadixNode | None = node
        chain = []
        while n is not None:
            if n.pin_count <= 0:
                raise BlockStateError("unpin of a node that is not pinned")
            chain.append(n)
            n = n.parent
        for n in chain:
            n.pin_count -= 1

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

    @staticmethod
    def path_to(entry: BlockEntry) -> list[BlockEntry]:
        """The indexed entries of ``entry``'s chain from its first block through ``entry`` (so a block's
        list index is its chain position); empty for an entry not in the index. Changes nothing."""
        node = entry.node
        if node is None:
            return []
        runs = [node.entries[: node.entries.index(entry) + 1]]
        n = node.parent
        while n is not None:
            runs.append(n.entries)
            n = n.parent
        return [e for run in reversed(runs) for e in run]

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _touch(self, node: RadixNode) -> None:
        """Make ``node`` most recently used (at the current clock)."""
        node.last_access = self._clock

    def remove_leaf(self, node: RadixNode) -> None:
        """Delete an unpinned leaf and its entries from the index.

        A deferred leaf goes without its entries ever being made (nobody is told): records of its blocks
        elsewhere are the caller's to clear. The store's placement reads a node's entries before it removes
        it, except for the leaf of a refused commit, whose GPU block records it has undone already.
        """
        if node is self.root or node.children or node.pin_count:
            raise BlockStateError("only an unpinned leaf can be removed")
        assert node.parent is not None
        keys = node.deferred_keys()
        del node.parent.children[keys[0] if keys is not None else node.entries[0].key]
        if node.tok_key is not None:
            del node.parent.tok_children[node.tok_key]
        node.parent = None
        if keys is not None:
            for k in keys:
                del self._by_key[k]
            node.drop_deferred()
            return
        for e in node.entries:
            del self._by_key[e.key]
            e.node = None

    def remove_tail(self, node: RadixNode, keep: int) -> list[BlockEntry]:
        """Drop the entries of a leaf after its first ``keep``; returns them (the leaf goes when ``keep`` is 0)."""
        if node.children or node.pin_count:
            raise BlockStateError("only an unpinned leaf can be truncated")
        if keep <= 0:
            dropped = list(node.entries)
            self.remove_leaf(node)
            return dropped
        dropped = node.entries[keep:]
        node.entries = node.entries[:keep]
        if node.tokens is not None:
            node.tokens = node.tokens[: keep * self.layout.block_size]
        for e in dropped:
            del self._by_key[e.key]
            e.node = None
        return dropped

    # ------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` if any invariant of the index is broken (:func:`.radix_check.check_index`)."""
        check_index(self.root, self.layout.block_size, self._by_key)
