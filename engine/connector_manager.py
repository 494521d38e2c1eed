"""A KV cache manager backed by a kvstore connector: prefix caching across GPU, host and disk.

Per sequence it keeps the lease of its cached prefix and the keys of its full
blocks::

    block_table: [ lease blocks (cached prefix) | blocks allocated for new tokens ]
                   released via connector.release   freed via connector.free
    keys:        one per full block of all_token_ids, grown as blocks fill;
                 blocks [0, committed) are in the store's index

Admission looks the prompt up (leaving at least one token to compute),
acquires the lease and resolves it (the stop policy runs here), so the step
computes only the uncached suffix; the model waits per layer for the lease's
blocks. Full blocks are committed as they fill, prompt and generated tokens
alike, so the next turn of a conversation hits them. Preemption either drops
the KV (``recompute``) or first saves the full blocks to the host tier
(``swap``), so readmission reloads them instead of recomputing; only the
partial last block is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from connectors.base import KVConnector, Lease
from engine.block_manager import BlockManager
from engine.sequence import SequenceState
from kvstore.errors import IntegrityError, OutOfBlocks
from kvstore.store.gpu_pool import GPUBlockPool

PreemptionMode = Literal["recompute", "swap"]


@dataclass
class _SeqCache:
    lease: Lease
    keys: list[bytes] = field(default_factory=list)
    committed: int = 0


class ConnectorBlockManager(BlockManager):
    """:class:`BlockManager` whose blocks come from (and go back to) a :class:`KVConnector`."""

    def __init__(self, pool: GPUBlockPool, connector: KVConnector, preemption: PreemptionMode = "recompute",
                 window: int = 0) -> None:
        """``window``: the model's sliding window when every layer has one (0: some layer attends to every key);
        a cached prefix's blocks before the first uncached token's window are then not loaded."""
        super().__init__(pool)
        if preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption must be 'recompute' or 'swap', got {preemption!r}")
        connector.register(pool)
        self.connector = connector
        self.preemption: PreemptionMode = preemption
        self.window = window
        self._seqs: dict[str, _SeqCache] = {}

    def admit(self, seq: SequenceState) -> None:
        """Hand ``seq`` its cached prefix (at most all full blocks but the one holding its last token)."""
        if seq.block_table or seq.request_id in self._seqs:
            raise IntegrityError(f"sequence {seq.request_id!r} admitted while holding blocks")
        bs = self.block_size
        tokens = seq.all_token_ids
        usable = (seq.num_tokens - 1) // bs  # one token must remain to produce logits
        match = self.connector.lookup(tokens[: usable * bs], seq.cache_salt)
        lease = self.connector.acquire(match, self.window)
        cached = lease.resolve()
        seq.block_table = list(lease.block_ids)
        seq.num_cached_tokens = cached
        seq.num_computed_tokens = cached
        seq.metrics.cached_tokens_by_tier = lease.tokens_by_tier()
        n = len(lease.block_ids)
        self._seqs[seq.request_id] = _SeqCache(lease, list(match.keys[:n]), committed=n)

    def allocate_slots(self, seq: SequenceState, num_new_tokens: int) -> bool:
        needed = seq.blocks_needed(seq.num_computed_tokens + num_new_tokens, self.block_size)
        if needed == 0:
            return True
        try:
            seq.block_table.extend(self.connector.allocate(needed))
        except OutOfBlocks:
            return False
        return True

    def before_layer(self, seqs: Sequence[SequenceState]) -> Callable[[int], None] | None:
        leases = [c.lease for s in seqs if (c := self._seqs.get(s.request_id)) is not None and c.lease.block_ids]
        if not leases:
            return None

        def wait(layer: int) -> None:
            for lease in leases:
                lease.wait_layer(layer)

        return wait

    def on_computed(self, seq: SequenceState) -> None:
        """Commit the blocks that became full in this step."""
        cache = self._seqs.get(seq.request_id)
        if cache is None:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if full <= cache.committed:
            return
        if len(cache.keys) < full:  # generated tokens filled more blocks: extend the chain
            parent = cache.keys[-1] if cache.keys else None
            start = len(cache.keys) * bs
            tokens = seq.all_token_ids[start : full * bs]
            if parent is None:
                cache.keys.extend(self.connector.keys(tokens, seq.cache_salt))
            else:
                cache.keys.extend(self.connector.keys(tokens, parent=parent))
        self.connector.commit_keys(cache.keys[:full], seq.block_table[:full], seq.all_token_ids[: full * bs],
                                   seq.cache_salt)
        cache.committed = full

    def preempt(self, seq: SequenceState) -> None:
        cache = self._seqs.get(seq.request_id)
        if self.preemption == "swap" and cache is not None and cache.committed:
            self.connector.save(cache.keys[: cache.committed])
        self.free(seq)

    def free(self, seq: SequenceState) -> None:
        cache = self._seqs.pop(seq.request_id, None)
        own = seq.block_table
        if cache is not None:
            n_lease = len(cache.lease.block_ids)
            own = seq.block_table[n_lease:]
            self.connector.release(cache.lease)
            seq.metrics.load_wait_time += cache.lease.load_wait_s
        if own:
            self.connector.free(own)
        seq.block_table = []
        seq.num_computed_tokens = 0
