"""The tiered store's statistics: per-tier counters and occupancy (:meth:`~kvstore.store.tiered.TieredStore.stats`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.util.budget import ByteBudget
    from kvstore.store.hierarchy import Hierarchy
    from kvstore.store.remote_writer import RemoteWriter


def store_stats(h: Hierarchy, prefetch_budget: ByteBudget, remote_writer: RemoteWriter | None) -> dict[str, Any]:
    """Per-tier counters and occupancy of a store's parts (a snapshot; changes nothing but applying pending events).

    Takes the parts, not the :class:`~kvstore.store.tiered.TieredStore`, so that the store imports this module and not the
    reverse.
    """
    h.sync_tier_events()
    tiers = h.lower_tiers()
    # outside the lock: the remote tier asks its server
    tier_stats: dict[str, dict[str, Any]] = {name: tier.stats().as_dict() for name, tier in tiers}
    with h.lock:
        c = h.counters
        out: dict[str, Any] = {
            "lookups": c.lookups,
            "prompt_tokens": c.prompt_tokens,
            "gpu": {
                "hit_tokens": c.hit_tokens["gpu"],
                "used_blocks": h.pool.num_used,
                "capacity_blocks": h.pool.num_blocks,
                "cached_blocks": h.placement.num_gpu_cached,
                "evictions": c.gpu_evictions,
            },
            "miss_tokens": c.prompt_tokens - sum(c.hit_tokens.values()),
            "index_blocks": len(h.index),
            "dropped_blocks": c.dropped_blocks,
            "load_failures": c.load_failures,
            "prefetch_backpressure_waits": prefetch_budget.waits,
        }
        for name, tier in tiers:
            d = tier_stats[name]
            d["hit_tokens"] = c.hit_tokens[name] + sum(c.hit_tokens[t] for t in tier.served_as)
            if tier.served_as:  # a daemon: its hits by the daemon tier that held them
                d["hit_tokens_by_tier"] = {t: c.hit_tokens[t] for t in tier.served_as}
            d["loaded_blocks"] = c.loaded_blocks[name]
            d["spilled_blocks"] = c.spilled_blocks[name]
            if name == "remote" and remote_writer is not None:
                counters = remote_writer.policy.counters
                d["skipped_groups"] = counters.incomplete
                d["shed_groups"] = counters.shed
            out[name] = d
    return out
