"""Radix index: matching, splitting, exact LRU eviction, pins, and a model-based property test."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import BlockStateError, IntegrityError
from kvstore.hashing import block_keys
from kvstore.layout import KVLayout
from kvstore.store.radix import RadixIndex

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=2, dtype="float16", model_id="radix")


def _keys(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return block_keys(tokens, LAYOUT, salt)


class _Ids:
    def __init__(self) -> None:
        self._it = itertools.count()

    def take(self, n: int) -> list[int]:
        return [next(self._it) for _ in range(n)]


def test_match_and_per_tier_split() -> None:
    idx = RadixIndex(LAYOUT)
    toks = list(range(10))  # 5 blocks
    keys = _keys(toks)
    idx.insert(keys, gpu_blocks=[0, 1, None, None, None], host_slots=[None, 7, 3, None, None], on_disk=[True] * 5,
               tokens=toks)
    m = idx.match(toks + [99, 98])
    assert m.num_blocks == 5
    assert (m.gpu_blocks, m.host_blocks, m.disk_blocks) == (2, 1, 2)
    assert [e.tier for e in m.entries] == ["gpu", "gpu", "host", "disk", "disk"]
    assert idx.match([0, 1, 2, 3, 7, 7]).num_blocks == 2
    assert idx.match([5, 5]).num_blocks == 0
    assert idx.match([0]).num_blocks == 0  # no full block, no match
    idx.check_integrity()


def test_salt_isolates_tenants() -> None:
    idx = RadixIndex(LAYOUT)
    toks = list(range(8))
    idx.insert(_keys(toks, "a"), gpu_blocks=[0, 1, 2, 3], tokens=toks, salt="a")
    assert idx.match(toks, salt="a").num_blocks == 4
    assert idx.match_keys(_keys(toks, "a")).num_blocks == 4
    assert idx.match(toks, salt="b").num_blocks == 0
    assert idx.match(toks).num_blocks == 0
    assert idx.match_keys(_keys(toks, "b")).num_blocks == 0


def test_insert_splits_on_divergence_and_reuses_existing() -> None:
    idx = RadixIndex(LAYOUT)
    a = _keys([1, 1, 2, 2, 3, 3, 4, 4])
    b = _keys([1, 1, 2, 2, 9, 9])
    idx.insert(a, gpu_blocks=[0, 1, 2, 3])
    res = idx.insert(b, gpu_blocks=[10, 11, 12])
    assert res.num_existing == 2
    assert [e.gpu_block for e in res.entries] == [0, 1, 12]  # existing entries untouched
    top = list(idx.root.children.values())
    assert len(top) == 1 and len(top[0].entries) == 2 and len(top[0].children) == 2
    # Inserting a prefix of an existing node adds nothing and does not split.
    res2 = idx.insert(a[:1], gpu_blocks=[20])
    assert res2.num_existing == 1 and res2.entries[0].gpu_block == 0
    assert len(top[0].entries) == 2
    idx.check_integrity()


def test_match_makes_path_most_recent_and_pins_block_removal() -> None:
    idx = RadixIndex(LAYOUT)
    ids = _Ids()
    seqs = {name: _keys([i, i, i + 50, i + 50]) for i, name in enumerate("abcde")}
    for name in "abcde":
        idx.insert(seqs[name], gpu_blocks=ids.take(2))
    idx.match_keys(seqs["b"])  # b becomes most recent
    idx.match_keys(seqs["a"])  # then a
    pinned = idx.match_keys(seqs["d"]).node  # then d
    names = {seqs[n][0]: n for n in seqs}
    by_age = sorted(idx.nodes(), key=lambda n: n.last_access)
    assert [names[n.entries[0].key] for n in by_age] == ["c", "e", "b", "a", "d"]
    idx.pin(pinned)
    with pytest.raises(BlockStateError, match="unpinned leaf"):
        idx.remove_leaf(pinned)
    assert idx.match_keys(seqs["d"]).num_blocks == 2  # pinned survived
    idx.unpin(pinned)
    idx.remove_leaf(pinned)
    assert idx.match_keys(seqs["d"]).num_blocks == 0
    idx.check_integrity()


def test_pin_protects_ancestors_and_unpin_balance() -> None:
    idx = RadixIndex(LAYOUT)
    base = _keys([1, 1, 2, 2])
    child = _keys([1, 1, 2, 2, 3, 3])
    idx.insert(base, gpu_blocks=[0, 1])
    idx.insert(child, gpu_blocks=[None, None, 2])
    leaf = idx.match_keys(child).node
    idx.pin(leaf)
    assert leaf.parent is not None and leaf.parent.pin_count == 1
    with pytest.raises(BlockStateError):
        idx.remove_tail(leaf, 0)
    idx.unpin(leaf)
    with pytest.raises(BlockStateError):
        idx.unpin(leaf)
    parent = leaf.parent
    idx.remove_leaf(leaf)
    idx.remove_leaf(parent)
    assert len(idx) == 0
    idx.check_integrity()


def test_integrity_detects_double_gpu_block_and_homeless_entry() -> None:
    idx = RadixIndex(LAYOUT)
    idx.insert(_keys([1, 1]), gpu_blocks=[5])
    idx.insert(_keys([2, 2]), gpu_blocks=[6])
    e = idx.get(_keys([2, 2])[0])
    assert e is not None
    e.gpu_block = 5  # corrupt the record on purpose
    with pytest.raises(IntegrityError, match="GPU block 5"):
        idx.check_integrity()
    e.gpu_block = None
    with pytest.raises(IntegrityError, match="no tier"):
        idx.check_integrity()
    with pytest.raises(ValueError, match="at least one tier"):
        idx.insert(_keys([3, 3]))


def test_remove_tail() -> None:
    idx = RadixIndex(LAYOUT)
    keys = _keys([1, 1, 2, 2, 3, 3])
    res = idx.insert(keys, gpu_blocks=[0, 1, 2], on_disk=[True, True, True])
    node = res.node
    dropped = idx.remove_tail(node, 1)
    assert [e.gpu_block for e in dropped] == [1, 2]
    assert idx.match_keys(keys).num_blocks == 1
    idx.check_integrity()


def test_key_conflict_changes_nothing() -> None:
    """A key already indexed under another prefix, or repeated in one chain, is refused and the index left as it was."""
    idx = RadixIndex(LAYOUT)
    a = [b"a" * 32, b"b" * 32, b"c" * 32]
    first = idx.insert(a, gpu_blocks=[0, 1, 2])
    with pytest.raises(IntegrityError, match="already indexed"):
        idx.insert([b"x" * 32, b"y" * 32, b"b" * 32], gpu_blocks=[3, 4, 5])  # b under another prefix
    with pytest.raises(IntegrityError, match="twice"):
        idx.insert([b"p" * 32, b"q" * 32, b"p" * 32], gpu_blocks=[6, 7, 8])
    assert len(idx) == 3
    assert [idx.get(k) for k in a] == list(first.entries)
    assert idx.get(b"x" * 32) is None and idx.get(b"p" * 32) is None
    assert list(idx.root.children) == [a[0]]
    idx.check_integrity()


def test_match_keys_bisects_a_chain_and_probes_other_lists() -> None:
    """A chain's indexed prefix is found from the tree path (split nodes included); a list that is not a chain
    from the root is matched key by key, as before."""
    idx = RadixIndex(LAYOUT)
    toks = list(range(40))  # 20 blocks
    keys = _keys(toks)
    idx.insert(keys[:12], gpu_blocks=list(range(12)))
    idx.insert(keys[:5] + _keys(toks[:10] + [99] * 10)[5:], gpu_blocks=[None] * 5 + list(range(100, 105)))
    for n in range(len(keys) + 1):
        m = idx.match_keys(keys[:n], count_hits=False)
        assert [e.key for e in m.entries] == keys[: min(n, 12)]
        assert m.node is (m.entries[-1].node if m.entries else idx.root)
    assert idx.match_keys(keys[3:], count_hits=False).num_blocks == 9  # not from the root: key by key
    assert idx.match_keys([keys[0], b"z" * 32, keys[2]], count_hits=False).num_blocks == 1
    idx.check_integrity()


# --------------------------------------------------------------------------- property test


class RadixMachine(RuleBasedStateMachine):
    """Random insert/match/pin/unpin/evict against a reference model of present keys."""

    def __init__(self) -> None:
        super().__init__()
        self.idx = RadixIndex(LAYOUT)
        self.present: set[bytes] = set()
        self.ids = _Ids()
        self.pins: list[tuple[object, set[bytes]]] = []

    token_lists = st.lists(st.integers(0, 2), min_size=2, max_size=12)
    chains = token_lists.map(lambda t: _keys(t))

    @rule(tokens=token_lists)
    def insert(self, tokens: list[int]) -> None:
        keys = _keys(tokens)
        res = self.idx.insert(keys, gpu_blocks=self.ids.take(len(keys)), tokens=tokens)
        expected_existing = 0
        while expected_existing < len(keys) and keys[expected_existing] in self.present:
            expected_existing += 1
        assert res.num_existing == expected_existing
        self.present.update(keys)

    @rule(tokens=token_lists)
    def match_tokens(self, tokens: list[int]) -> None:
        keys = _keys(tokens)
        m = self.idx.match(tokens)
        assert [e.key for e in m.entries] == [e.key for e in self.idx.match_keys(keys).entries]

    @rule(keys=chains)
    def match(self, keys: list[bytes]) -> None:
        m = self.idx.match_keys(keys)
        expected = 0
        while expected < len(keys) and keys[expected] in self.present:
            expected += 1
        assert m.num_blocks == expected
        assert [e.key for e in m.entries] == keys[:expected]

    @rule(keys=chains)
    def pin(self, keys: list[bytes]) -> None:
        m = self.idx.match_keys(keys)
        if m.num_blocks == 0:
            return
        self.idx.pin(m.node)
        self.pins.append((m.node, set(keys[: m.num_blocks])))

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 1000))
    def unpin(self, i: int) -> None:
        node, _ = self.pins.pop(i % len(self.pins))
        self.idx.unpin(node)  # type: ignore[arg-type]

    @rule()
    def evict(self) -> None:
        """Remove the least recently used unpinned leaf (ties deepest first), as a cache would."""
        leaves = [n for n in self.idx.nodes() if n.is_leaf and n.pin_count == 0]
        victim = min(leaves, key=lambda n: (n.last_access, -self.idx.depth(n)), default=None)
        protected = set().union(*(k for _, k in self.pins)) if self.pins else set()
        if victim is None:
            # Nothing evictable: every leaf must be pinned.
            assert all(n.pin_count > 0 for n in self.idx.nodes() if n.is_leaf)
            return
        self.idx.remove_leaf(victim)
        gone = {e.key for e in victim.entries}
        assert gone <= self.present and not gone & protected
        self.present -= gone

    @invariant()
    def consistent(self) -> None:
        self.idx.check_integrity()
        assert len(self.idx) == len(self.present)


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
