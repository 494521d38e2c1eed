"""Cross-checks of a tiered store: the index's residency must agree with the pool and the tiers."""

from __future__ import annotations

from kvstore.errors import IntegrityError
from kvstore.store.hierarchy import Hierarchy
from kvstore.store.radix import BlockEntry


def check_store(h: Hierarchy) -> None:
    """Raise :class:`IntegrityError` unless every recorded copy exists where the index says.

    Checks the index and pool invariants, then per entry: a GPU block has a
    reference (the index's), a host slot holds that key, an on-disk block is
    on disk; the GPU eviction queue holds exactly the blocks only the cache
    holds. Applies pending tier events first, since they are how tiers
    report their own evictions.
    """
    h.sync_tier_events()
    with h.lock:
        h.index.check_integrity()
        h.pool.check_integrity()
        problems = placement_problems(h)
        if problems:
            raise IntegrityError("; ".join(problems))
        for node in h.index.nodes():
            for e in node.entries:
                tag = e.key.hex()[:16]
                if e.gpu_block is not None and h.pool.ref_count(e.gpu_block) < 1:
                    raise IntegrityError(f"block {tag}: GPU block {e.gpu_block} is free but indexed")
                if e.host_slot is not None:
                    if h.host is None:
                        raise IntegrityError(f"block {tag}: host slot recorded without a host tier")
                    if h.host.slot_of(e.key) != e.host_slot:
                        raise IntegrityError(f"block {tag}: index says host slot {e.host_slot}, host says {h.host.slot_of(e.key)}")
                # A disk tier that cannot report evictions is asked at lookup; its hint may be stale.
                if e.on_disk and (h.disk is None or (h.disk_reports_evictions and not h.disk.contains(e.key))):
                    raise IntegrityError(f"block {tag}: index says on disk but the disk tier lacks it")


def placement_problems(h: Hierarchy) -> list[str]:
    """Problems with the GPU eviction queue and the GPU block map of ``h.placement`` (empty when consistent).

    Call with the lock held. Changes nothing (but makes the entries of deferred runs, as any read does).
    """
    pl = h.placement
    out: list[str] = []
    indexed: dict[int, BlockEntry] = {}
    for node in h.index.nodes():
        for e in node.entries:
            if e.gpu_block is not None:
                indexed[e.gpu_block] = e
    recorded = {b: rec for b in range(h.pool.num_blocks) if (rec := pl.entry_of(b)) is not None}
    if indexed.keys() != recorded.keys() or any(indexed[b] is not e for b, e in recorded.items()):
        out.append("the GPU block map differs from the index")
    if len(recorded) != pl.num_gpu_cached:
        out.append(f"the GPU block map counts {pl.num_gpu_cached} blocks but holds {len(recorded)}")
    want = {b for b, e in indexed.items() if pl.evictable(e)}
    if want != set(pl.gpu_lru.order()):
        out.append(f"eviction queue holds {sorted(pl.gpu_lru.order())}, evictable blocks are {sorted(want)}")
    return out
