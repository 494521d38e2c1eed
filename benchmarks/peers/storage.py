"""The ``peers`` suite's disk and host rows: kvstore's tiers beside LMCache's backends and the machine's limits.

Every round, per block size, on the same KV-like blocks
(:func:`kvstore.bench.kvdata.kv_like_blocks`, also written to
``pool-<bytes>.bin`` for the LMCache peer, :mod:`.lmcache_storage`):

- disk (256 KiB, 1 MiB): ``kvstore.lmdb.put`` = ``DiskTier.put`` of every
  block + ``flush()`` (durable), ``kvstore.lmdb.get_cold`` = its get after the
  page cache is dropped (:func:`kvstore.bench.tier_runs.run_tier`, in a fresh
  directory each round); ``kvstore.slab.put`` / ``.get_cold`` the same through the
  opt-in ``SlabTier`` (``disk.backend: slab``: ``O_DIRECT`` slots); then the raw limits in the same directory
  (:func:`kvstore.bench.rawio.direct_io_gbps`): ``raw.write`` (sequential
  ``O_DIRECT`` + ``fsync``), ``raw.read`` and ``raw.read_parallel`` (requests
  of the block size from several threads, the best of them);
- host (64 KiB, 256 KiB, 1 MiB): ``memcpy.per_block`` and ``memcpy`` of the
  same bytes, then ``kvstore.host.put`` / ``kvstore.host.get`` (``HostTier``,
  arena prefaulted).

The LMCache peer's rows of the same round (``lmcache.disk.<mode>.put`` /
``.get`` / ``.batched_get``, ``lmcache.cpu.put`` / ``.get``) join these;
``lmcache.disk.best.put`` / ``.get`` are, per round, the fastest of its modes.
Every ratio is kvstore's GB/s over the reference's, the median of the
per-round ratios (above 1 = kvstore faster).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from matplotlib.axes import Axes

from kvstore.bench.harness import Results, SuiteError, SuiteOptions, scratch_dir
from kvstore.bench.kvdata import kv_like_blocks
from kvstore.bench.plots import grouped_bars
from kvstore.bench.rawio import direct_io_gbps, memcpy_gbps, memcpy_per_block_gbps
from kvstore.bench.tier_runs import run_tier
from kvstore.bench.tiers import (HOST_TARGET, POOL_BYTES, READ_THREADS, TARGET_OF_LIMIT, TARGET_OF_PARALLEL_READ,
                                 block_layout, tier_openers)

DISK_SIZES = (256 << 10, 1 << 20)
HOST_SIZES = (64 << 10, 256 << 10, 1 << 20)
FULL_BYTES = 128 << 20
"""Bytes per put of every row (128 MiB: a round of the disk rows takes seconds here)."""
QUICK_BYTES = 8 << 20
LMCACHE_MODES = ("buffered", "odirect")
BEST = {"lmcache.disk.best.put": tuple(f"lmcache.disk.{m}.put" for m in LMCACHE_MODES),
        "lmcache.disk.best.get": tuple(f"lmcache.disk.{m}.{op}" for m in LMCACHE_MODES for op in ("get", "batched_get"))}
"""Derived row -> the LMCache rows it is the per-round best of."""
PAIRS: tuple[tuple[str, str, str, float | None], ...] = (
    ("kvstore.lmdb.put/raw.write", "kvstore.lmdb.put", "raw.write", TARGET_OF_LIMIT),
    ("kvstore.lmdb.put/lmcache.disk.best.put", "kvstore.lmdb.put", "lmcache.disk.best.put", 1.0),
    ("kvstore.lmdb.put/lmcache.disk.buffered.put", "kvstore.lmdb.put", "lmcache.disk.buffered.put", None),
    ("kvstore.lmdb.get_cold/raw.read_parallel", "kvstore.lmdb.get_cold", "raw.read_parallel", TARGET_OF_PARALLEL_READ),
    ("kvstore.lmdb.get_cold/lmcache.disk.best.get", "kvstore.lmdb.get_cold", "lmcache.disk.best.get", 1.0),
    ("kvstore.slab.put/raw.write", "kvstore.slab.put", "raw.write", TARGET_OF_LIMIT),
    ("kvstore.slab.put/lmcache.disk.best.put", "kvstore.slab.put", "lmcache.disk.best.put", 1.0),
    ("kvstore.slab.get_cold/raw.read_parallel", "kvstore.slab.get_cold", "raw.read_parallel", TARGET_OF_PARALLEL_READ),
    ("kvstore.slab.get_cold/lmcache.disk.best.get", "kvstore.slab.get_cold", "lmcache.disk.best.get", 1.0),
    ("kvstore.host.put/memcpy.per_block", "kvstore.host.put", "memcpy.per_block", HOST_TARGET),
    ("kvstore.host.get/memcpy.per_block", "kvstore.host.get", "memcpy.per_block", HOST_TARGET),
    ("kvstore.host.put/memcpy", "kvstore.host.put", "memcpy", HOST_TARGET),
    ("kvstore.host.get/memcpy", "kvstore.host.get", "memcpy", HOST_TARGET),
    ("kvstore.host.put/lmcache.cpu.put", "kvstore.host.put", "lmcache.cpu.put", None),
    ("kvstore.host.get/lmcache.cpu.get", "kvstore.host.get", "lmcache.cpu.get", None),
)
"""(ratio name, kvstore figure, reference figure, target): ratio = kvstore GB/s / reference GB/s."""

Samples = dict[tuple[str, int], list[float]]
"""(row, block bytes) -> GB/s per round."""


@dataclass(frozen=True)
class StorageBench:
    """The blocks of every size and where they are shared with the LMCache peer."""

    options: SuiteOptions
    data: Path
    """Directory holding ``pool-<bytes>.bin``; the LMCache peer writes its files under it too."""
    total: int
    """Bytes per put (rounded down to whole blocks)."""
    pools: dict[int, torch.Tensor]
    """Block bytes -> ``uint8 [count, bytes]`` distinct blocks, cycled through by every put."""

    def peer_args(self) -> list[str]:
        """The LMCache peer's storage options for these blocks."""
        return ["--data", str(self.data), "--disk-sizes", ",".join(map(str, DISK_SIZES)), "--host-sizes",
                ",".join(map(str, HOST_SIZES)), "--disk-bytes", str(self.total), "--host-bytes", str(self.total)]


def prepare(options: SuiteOptions, data: Path) -> StorageBench:
    """Make the blocks of every size and write them into ``data`` for the peer; changes nothing else."""
    total = QUICK_BYTES if options.quick else FULL_BYTES
    pools = {}
    for bpb in sorted(set(DISK_SIZES) | set(HOST_SIZES)):
        pools[bpb] = kv_like_blocks(block_layout(bpb), max(1, min(total, POOL_BYTES) // bpb), options.seed)
        pools[bpb].numpy().tofile(data / f"pool-{bpb}.bin")
    return StorageBench(options, data, total, pools)


def kvstore_round(bench: StorageBench, results: Results, r: int) -> dict[tuple[str, int], float]:
    """One round of kvstore's rows and the machine's limits; ``{(row, block bytes): GB/s}``."""
    out: dict[tuple[str, int], float] = {}
    for bpb in DISK_SIZES:
        n = bench.total // bpb
        with scratch_dir(bench.options) as root:
            openers = tier_openers(block_layout(bpb), root, n * bpb, "none", results)
            for tier in ("lmdb", "slab"):
                opener = openers.get(tier)
                if opener is not None:
                    t = run_tier(opener, bench.pools[bpb], n, f"peers/{tier}/{bpb}/{r}", root / tier)
                    if t.hit_fraction != 1.0:
                        raise SuiteError(f"{tier} cold get found {t.hit_fraction:.3f} of the blocks it stored ({bpb} B)")
                    out[(f"kvstore.{tier}.put", bpb)], out[(f"kvstore.{tier}.get_cold", bpb)] = t.put_gbps, t.get_gbps
            raw = direct_io_gbps(root, n * bpb, parallel_request=bpb, parallel_threads=READ_THREADS)
        out[("raw.write", bpb)], out[("raw.read", bpb)] = raw.write_gbps, raw.read_gbps
        out[("raw.read_parallel", bpb)] = raw.parallel_read_gbps or 0.0
    for bpb in HOST_SIZES:
        n = bench.total // bpb
        out[("memcpy.per_block", bpb)] = memcpy_per_block_gbps(n * bpb, bpb)
        out[("memcpy", bpb)] = memcpy_gbps(n * bpb)
        opener = tier_openers(block_layout(bpb), bench.data, n * bpb, "none", results).get("host")
        if opener is not None:
            t = run_tier(opener, bench.pools[bpb], n, f"peers/host/{bpb}/{r}", None, prefault=True)
            out[("kvstore.host.put", bpb)], out[("kvstore.host.get", bpb)] = t.put_gbps, t.get_gbps
    return out


def report(results: Results, samples: Samples, total: int) -> None:
    """Medians of every row (the per-round best of LMCache's disk modes added) and the paired ratios."""
    for best, modes in BEST.items():
        for bpb in DISK_SIZES:
            per_mode = [samples[(m, bpb)] for m in modes if (m, bpb) in samples]
            if per_mode:
                samples[(best, bpb)] = [max(vals) for vals in zip(*per_mode)]
    for (name, bpb), gbps in sorted(samples.items()):
        results.add(name, statistics.median(gbps), "GB/s", block_bytes=bpb, total_bytes=total // bpb * bpb,
                    rounds=[round(x, 4) for x in gbps])
    for label, ours, ref, target in PAIRS:
        for bpb in sorted(set(DISK_SIZES) | set(HOST_SIZES)):
            a, b = samples.get((ours, bpb)), samples.get((ref, bpb))
            if a and b:
                per_round = [x / y for x, y in zip(a, b)]
                results.ratio(label, statistics.median(per_round), 1.0, target, block_bytes=bpb,
                              rounds=[round(x, 3) for x in per_round])


def plot(results: Results, disk_ax: Axes, host_ax: Axes) -> None:
    """GB/s of the disk rows and of the host rows per block size, kvstore beside LMCache and the limits."""
    panels = ((disk_ax, DISK_SIZES, ("kvstore.lmdb.put", "kvstore.slab.put", "lmcache.disk.best.put", "raw.write",
                                     "kvstore.lmdb.get_cold", "kvstore.slab.get_cold", "lmcache.disk.best.get",
                                     "raw.read_parallel"), "disk: durable put, cold get"),
              (host_ax, HOST_SIZES, ("kvstore.host.put", "lmcache.cpu.put", "kvstore.host.get", "lmcache.cpu.get",
                                     "memcpy.per_block"), "host: put / get"))
    for ax, sizes, names, title in panels:
        series = {n: [next((f.value for f in results.figures if f.name == n and f.params.get("block_bytes") == b),
                           float("nan")) for b in sizes] for n in names}
        grouped_bars(ax, [f"{b >> 10} KiB" for b in sizes], series, "GB/s", title)
