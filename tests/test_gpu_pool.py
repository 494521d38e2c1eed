"""GPU block pool: allocation, reference counts, fork, copy-on-write, layer views, property test."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import BlockStateError, OutOfBlocks
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout


def test_allocate_free_and_exhaustion(layout: KVLayout) -> None:
    pool = GPUBlockPool(layout, 4, device="cpu")
    assert pool.kv.shape == (4, *layout.block_shape)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(OutOfBlocks) as info:
        pool.allocate(2)
    assert info.value.requested == 2 and info.value.free == 1
    assert pool.num_free == 1  # a failed allocation takes nothing
    assert pool.try_allocate(2) is None
    assert pool.free(a) == a
    assert pool.num_free == 4
    with pytest.raises(BlockStateError, match="reference count 0"):
        pool.free([a[0]])
    with pytest.raises(BlockStateError, match="out of range"):
        pool.free([99])
    pool.check_integrity()


def test_fork_and_copy_on_write(layout: KVLayout) -> None:
    pool = GPUBlockPool(layout, 6, device="cpu")
    table = pool.allocate(2)
    pool.block(table[1]).fill_(3.0)
    child = pool.fork(table)
    assert child == table and pool.ref_count(table[1]) == 2
    new = pool.copy_on_write(child, 1)
    assert new != table[1] and child[1] == new and child[0] == table[0]
    assert torch.equal(pool.block(new), pool.block(table[1]))
    assert pool.ref_count(table[1]) == 1 and pool.ref_count(new) == 1
    pool.block(new).fill_(5.0)
    assert float(pool.block(table[1]).flatten()[0]) == 3.0  # the parent's copy is untouched
    assert pool.copy_on_write(child, 1) == new  # private already: no copy
    pool.check_integrity()


def test_copy_on_write_out_of_blocks_leaves_table(layout: KVLayout) -> None:
    pool = GPUBlockPool(layout, 2, device="cpu")
    table = pool.allocate(2)
    child = pool.fork(table)
    with pytest.raises(OutOfBlocks):
        pool.copy_on_write(child, 0)
    assert child == table and pool.ref_count(table[0]) == 2


def test_layer_views_alias_the_pool(layout: KVLayout) -> None:
    pool = GPUBlockPool(layout, 8, device="cpu")
    bs = layout.block_size
    k, v = pool.layer_kv(1)
    assert k.shape == (8, bs, layout.num_kv_heads, layout.head_dim)
    k[5, 2].fill_(7.0)
    assert float(pool.kv[5, 1, 0, 2, 0, 0]) == 7.0  # the view aliases the pool
    assert pool.block_bytes(5).numel() == layout.bytes_per_block


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/free/fork/copy-on-write against a reference count model."""

    def __init__(self) -> None:
        super().__init__()
        self.layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2, dtype="float32")
        self.pool = GPUBlockPool(self.layout, 12, device="cpu")
        self.tables: list[list[int]] = []
        self.marks: dict[int, float] = {}  # what each sequence last wrote into each of its blocks
        self.next_mark = 1.0

    def _refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for t in self.tables:
            for b in t:
                refs[b] = refs.get(b, 0) + 1
        return refs

    @rule(n=st.integers(0, 5))
    def allocate(self, n: int) -> None:
        free_before = self.pool.num_free
        if n > free_before:
            with pytest.raises(OutOfBlocks):
                self.pool.allocate(n)
            assert self.pool.num_free == free_before
            return
        table = self.pool.allocate(n)
        for b in table:
            self.pool.block(b).fill_(self.next_mark)
            self.marks[b] = self.next_mark
            self.next_mark += 1
        self.tables.append(table)

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        self.pool.free(self.tables.pop(i % len(self.tables)))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100))
    def fork(self, i: int) -> None:
        self.tables.append(self.pool.fork(self.tables[i % len(self.tables)]))

    @precondition(lambda self: any(self.tables))
    @rule(i=st.integers(0, 100), j=st.integers(0, 100))
    def write(self, i: int, j: int) -> None:
        tables = [t for t in self.tables if t]
        table = tables[i % len(tables)]
        idx = j % len(table)
        old = table[idx]
        shared = self._refs()[old] > 1
        if shared and self.pool.num_free == 0:
            with pytest.raises(OutOfBlocks):
                self.pool.copy_on_write(table, idx)
            assert table[idx] == old
            return
        b = self.pool.copy_on_write(table, idx)
        assert (b != old) == shared
        if shared:  # the copy starts with the shared contents
            assert float(self.pool.block(b).flatten()[0]) == self.marks[old]
        self.pool.block(b).fill_(self.next_mark)
        self.marks[b] = self.next_mark
        self.next_mark += 1

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        refs = self._refs()
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_count(b) == refs.get(b, 0)
        for b in refs:  # no write through one table ever changed a block another table still shares
            assert float(self.pool.block(b).flatten()[0]) == self.marks[b]


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=50, stateful_step_count=60, deadline=None)
