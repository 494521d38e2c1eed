"""Property test of placement: random request sequences across GPU, host and disk against a simple model.

The model is what each block's KV must be (a pure function of its key) and
what each tier really holds. After every step the store's invariants hold
(``check_integrity``: index, pool, host slots and the GPU eviction queue
agree); every lookup reports only blocks its tier really has (no phantom
hit), every loaded block has the right bytes, and at the end no GPU
reference or host pin is left over.
"""

from __future__ import annotations

from collections.abc import Sequence

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import OutOfBlocks
from kvstore.store.prefetch import StoreLease
from kvstore.tiers.base import Buffer

from storelib import LAYOUT, MemoryTier, make_store

BS = LAYOUT.block_size
DOCS = [[d * 1000 + i for i in range(5 * BS)] for d in range(4)]


def _content(key: bytes) -> torch.Tensor:
    """The KV every writer produces for ``key``."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randn(LAYOUT.block_shape, generator=g).to(LAYOUT.torch_dtype)


class FaultyDisk(MemoryTier):
    """A disk that can lose blocks silently (no event: a daemon) or fail a read (corrupt: deleted on get)."""

    reports_evictions = False

    def __init__(self) -> None:
        super().__init__(LAYOUT, capacity_blocks=10)
        self.corrupt: set[bytes] = set()

    def get(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        with self._lock:
            for k in keys:
                if k in self.corrupt:  # fails verification: deleted, reported as a miss
                    self.data.pop(k, None)
                    self.corrupt.discard(k)
        return super().get(keys, dests)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.disk = FaultyDisk()
        self.s = make_store(gpu_blocks=8, host_blocks=3, disk=self.disk, write="write_back")
        self.leases: list[tuple[StoreLease, list[int], bool]] = []  # lease, tokens, resolved
        self.owned: list[int] = []

    # ------------------------------------------------------------------ requests
    @precondition(lambda self: len(self.leases) < 2)
    @rule(doc=st.integers(0, len(DOCS) - 1), nblocks=st.integers(1, 5))
    def lookup_acquire(self, doc: int, nblocks: int) -> None:
        tokens = DOCS[doc][: nblocks * BS]
        m = self.s.lookup(tokens)
        host = self.s.h.host
        assert host is not None
        for key, tier in zip(m.keys, m.tiers):  # no phantom hit: every reported block is where it is said to be
            if tier == "host":
                assert host.contains(key), "phantom host hit"
            elif tier == "disk":
                assert self.disk.contains(key), "phantom disk hit"
        self.leases.append((self.s.acquire(m), tokens, False))

    @precondition(lambda self: not self.leases)
    @rule(doc=st.integers(0, len(DOCS) - 1), nblocks=st.integers(1, 5))
    def serve(self, doc: int, nblocks: int) -> None:
        """A whole request in one step: lookup, acquire, resolve, compute and commit the rest, release."""
        self.lookup_acquire(doc, nblocks)
        self.resolve()
        self.commit()
        self.release(0)

    @precondition(lambda self: any(not r for _, _, r in self.leases))
    @rule()
    def resolve(self) -> None:
        i = next(i for i, (_, _, r) in enumerate(self.leases) if not r)
        lease, tokens, _ = self.leases[i]
        lease.resolve()
        lease.wait()
        keys = self.s.keys(tokens)
        for k, b in zip(keys, lease.block_ids):
            assert torch.equal(self.s.pool.block(b), _content(k)), "wrong KV loaded"
        self.leases[i] = (lease, tokens, True)

    @precondition(lambda self: any(r for _, _, r in self.leases))
    @rule()
    def commit(self) -> None:
        """Compute the rest of a resolved lease's prompt and commit it."""
        lease, tokens, _ = next(x for x in self.leases if x[2])
        keys = self.s.keys(tokens)
        n = len(lease.block_ids)
        try:
            new = self.s.allocate(len(keys) - n)
        except OutOfBlocks:
            return
        for k, b in zip(keys[n:], new):
            self.s.pool.block(b).copy_(_content(k))
        self.s.commit(keys, lease.block_ids + new, tokens)
        self.s.free(new)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 10))
    def release(self, i: int) -> None:
        lease, _, _ = self.leases.pop(i % len(self.leases))
        self.s.release(lease)

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        try:
            self.owned.extend(self.s.allocate(n))
        except OutOfBlocks:
            pass

    @precondition(lambda self: self.owned)
    @rule()
    def free(self) -> None:
        self.s.free(self.owned)
        self.owned = []

    @rule(tier=st.sampled_from(["gpu", "host"]))
    def offload(self, tier: str) -> None:
        self.s.offload(tier)

    # -------------------------------------------------------------------- faults
    @precondition(lambda self: self.disk.data)
    @rule(i=st.integers(0, 100))
    def disk_evicts_silently(self, i: int) -> None:
        with self.disk._lock:
            self.disk.data.pop(list(self.disk.data)[i % len(self.disk.data)])

    @precondition(lambda self: self.disk.data)
    @rule(i=st.integers(0, 100))
    def disk_block_corrupt(self, i: int) -> None:
        self.disk.corrupt.add(list(self.disk.data)[i % len(self.disk.data)])

    # ---------------------------------------------------------------- invariants
    @invariant()
    def placement_consistent(self) -> None:
        self.s.check_integrity()

    def teardown(self) -> None:
        for lease, _, _ in self.leases:
            self.s.release(lease)
        self.s.free(self.owned)
        self.s.flush()
        self.s.check_integrity()
        host = self.s.h.host
        assert host is not None and host.num_pinned == 0, "host slot pin leaked"
        indexed_gpu = sum(1 for n in self.s.index.nodes() for e in n.entries if e.gpu_block is not None)
        assert self.s.pool.num_used == indexed_gpu, "GPU reference leaked"
        assert all(self.s.pool.ref_count(e.gpu_block) == 1  # type: ignore[arg-type]
                   for n in self.s.index.nodes() for e in n.entries if e.gpu_block is not None)
        self.s.close()


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=15, stateful_step_count=25, deadline=None)
