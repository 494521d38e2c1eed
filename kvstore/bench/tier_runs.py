"""Timed puts and gets through one tier, and the cold-read preparation of the disk tiers.

A run stores ``n`` blocks (cycling through a pool of distinct KV-like
blocks) under fresh keys in batches of about :data:`BATCH_BYTES`, makes them
durable (``flush``), then reads them back into preallocated destinations.
"Cold" means the tier's files are out of the page cache: the cache is
dropped when running as root and the kernel allows it, otherwise the tier is
closed, each of its files gets ``posix_fadvise(DONTNEED)`` and the tier is
reopened (the method used is returned so the results can say it).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvstore.bench.rawio import drop_page_cache, evict_file

if TYPE_CHECKING:  # the tiers are imported by the suite only when they exist
    from kvstore.tiers.base import Tier

BATCH_BYTES = 32 << 20
"""Bytes per put/get call: about one long prefix's worth of blocks."""


@dataclass(frozen=True)
class TierTiming:
    """Bandwidths of one run, in GB/s of raw block bytes (1e9 B/s)."""

    put_gbps: float
    """Put of every block, then ``flush`` (durable for disk tiers)."""
    warm_get_gbps: float
    """Get right after the put (page cache warm)."""
    get_gbps: float
    """Get after the cold preparation (equal to the warm get without ``cold_dir``)."""
    cold_method: str | None
    """How the page cache was emptied before the get (``None``: warm read)."""
    hit_fraction: float
    """Fraction of the blocks the get found (1.0 unless the tier evicted some)."""
    limit_gbps: float | None = None
    """The ``limit`` callable's mean just before and just after the cold get (``None``: no ``limit``)."""
    put_evicting_gbps: float | None = None
    """Put of ``n`` more blocks (then ``flush``) into the full tier, each evicting one (``evicting`` runs only):
    the steady state of a tier that makes its own room (the daemon's host tier, a long-running disk tier)."""


def bench_keys(n: int, tag: str) -> list[bytes]:
    """``n`` distinct 32-byte keys, different for every ``tag``."""
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest() for i in range(n)]


def make_cold(tier_dir: Path, reopen: Callable[[], "Tier"], tier: "Tier") -> tuple["Tier", str]:
    """Close ``tier``, empty the page cache of its files, reopen it; returns the new tier and the method."""
    tier.close()
    if drop_page_cache():
        return reopen(), "drop_caches"
    for root, _, files in os.walk(tier_dir):
        for name in files:
            evict_file(Path(root) / name)
    return reopen(), "reopen+fadvise(DONTNEED)"


def run_tier(open_tier: Callable[[], "Tier"], pool: torch.Tensor, n: int, tag: str,
             cold_dir: Path | None, prefault: bool = False, evicting: bool = False,
             limit: Callable[[], float] | None = None) -> TierTiming:
    """Put ``n`` blocks, flush, get them warm, optionally make the tier cold (``cold_dir``) and get again.

    ``prefault`` first fills and empties the tier once, untimed, so a
    long-lived tier's steady state is measured rather than the first touch of
    freshly allocated memory (used for the host arena). ``evicting`` then puts
    ``n`` new blocks into the full tier (timed, :attr:`TierTiming.put_evicting_gbps`;
    the tier must hold about ``n`` blocks and evict by itself). ``limit`` (the
    machine's limit for the cold get, GB/s) is measured right before and right
    after the cold get, so the ratio pairs readings seconds apart rather than
    minutes (the VM's disk drifts by 1.5x within a run). Closes the tier.
    """
    tier = open_tier()
    bpb = pool.shape[1]
    per_batch = max(1, BATCH_BYTES // bpb)
    keys = bench_keys(n, tag)
    srcs = [pool[i % pool.shape[0]] for i in range(n)]
    dests = torch.empty((min(n, per_batch), bpb), dtype=torch.uint8)
    dests.fill_(1)  # fault the destination pages in before timing
    if prefault:
        warm = bench_keys(n, f"{tag}/prefault")
        for s in range(0, n, per_batch):
            tier.put(warm[s : s + per_batch], srcs[s : s + per_batch])
        tier.delete(warm)
    t0 = time.perf_counter()
    for s in range(0, n, per_batch):
        tier.put(keys[s : s + per_batch], srcs[s : s + per_batch])
    tier.flush()
    t_put = time.perf_counter() - t0
    t_warm, found = _get_all(tier, keys, dests)
    t_get, method, limits = t_warm, None, []
    if cold_dir is not None:
        tier, method = make_cold(cold_dir, open_tier, tier)
        limits += [limit()] if limit else []
        t_get, found = _get_all(tier, keys, dests)
        limits += [limit()] if limit else []
    t_evicting = None
    if evicting:
        more = bench_keys(n, f"{tag}/evicting")
        t0 = time.perf_counter()
        for s in range(0, n, per_batch):
            tier.put(more[s : s + per_batch], srcs[s : s + per_batch])
        tier.flush()
        t_evicting = time.perf_counter() - t0
    tier.close()
    total = n * bpb
    return TierTiming(total / t_put / 1e9, total / t_warm / 1e9, total / t_get / 1e9, method, found / n,
                      sum(limits) / len(limits) if limits else None, total / t_evicting / 1e9 if t_evicting else None)


def _get_all(tier: "Tier", keys: list[bytes], dests: torch.Tensor) -> tuple[float, int]:
    """Seconds to get every key in batches of ``len(dests)``, and how many were found."""
    found = 0
    per_batch = dests.shape[0]
    t0 = time.perf_counter()
    for s in range(0, len(keys), per_batch):
        batch = keys[s : s + per_batch]
        found += sum(tier.get(batch, list(dests[: len(batch)])))
    return time.perf_counter() - t0, found
