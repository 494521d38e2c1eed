"""Suite ``tiers``: each tier's bandwidth beside the machine's limit for the same bytes, in one run.

For every block size (64 KiB to 4 MiB, through KVLayouts of 4 layers x 8
KV heads x head_dim 128 in fp16 with 4 to 256 tokens per block):

- host tier put / get  vs  memcpy of the same total bytes (one copy) and
  vs per-block memcpy (one ``memmove`` per block, measured right before);
  the put both into free slots and into the full tier, each block evicting
  one (``host.put_evicting``: the daemon's host tier in steady state);
- LMDB, file and slab tier put (+ flush)  vs  raw sequential direct write
  (+ fsync), LMDB's also vs a buffered write of a new file (+ fsync) right
  before it (``raw.write_buffered``: the page-cache writer's limit, which
  this VM's memory ballooning makes vary), LMDB's and slab's also into the
  full tier (``put_evicting``: a second fill that evicts the first, the
  steady state of a long-running disk tier), and their *cold* gets  vs  raw sequential direct read, all in
  the same directory; LMDB against the file tier directly; LMDB alone
  (plain ``txn.put``, :mod:`kvstore.bench.lmdb_txn`) by transaction size,
  1 to 16 MiB (``lmdb_raw.put``), the reason for the disk tier's
  transaction bound; the targets
  (0.7 of raw write, 0.8 of the parallel read limit) on LMDB and slab;
- the disk's parallel read limit: the same file read with requests of the
  block size from :data:`READ_THREADS` threads on one ``O_DIRECT``
  descriptor (best of them), the denominator of the cold-get target:
  measured at the start of each block size (``raw.read_parallel``) and, for
  LMDB and slab, again right before and right after the tier's cold get
  (``raw.read_parallel.around_<tier>``, the mean of the two), which the
  target's ratio uses (this VM's disk drifts by up to 1.5x within a run);

and at 1 MiB blocks the codecs ``none`` / ``zstd`` / ``shuffle_zstd``:
encode and decode bandwidth, compression ratio on KV-like fp16 data
(:mod:`kvstore.bench.kvdata`), and cold LMDB reads through each codec.
Tiers that are not importable yet are skipped with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.bench.harness import Progress, Results, SuiteOptions, scratch_dir
from kvstore.bench.kvdata import kv_like_blocks
from kvstore.bench.lmdb_txn import TXN_SIZES, lmdb_put_gbps
from kvstore.bench.plots import grid, grouped_bars, save
from kvstore.bench.rawio import (
    RAW_FILE, best_parallel_read, buffered_write_gbps, direct_io_gbps, memcpy_gbps, memcpy_per_block_gbps,
)
from kvstore.bench.tier_runs import run_tier
from kvstore.tiers.codec import decode_into, encode
from kvstore.layout import KVLayout

TOKENS_PER_BLOCK = {64 << 10: 4, 256 << 10: 16, 1 << 20: 64, 4 << 20: 256}
QUICK_SIZES = (64 << 10, 1 << 20)
CODECS = ("none", "zstd", "shuffle_zstd")
CODEC_BLOCK = 1 << 20
POOL_BYTES = 64 << 20
TARGET_OF_LIMIT = 0.7
TARGET_OF_PARALLEL_READ = 0.8
READ_THREADS = (4, 8)
HOST_TARGET = 0.85
"""Host tier put and get, as a share of memcpy's bandwidth on the same buffers (the machine's limit)."""
SMALL_BLOCK = 256 << 10
TARGETED = ("lmdb", "slab")
"""The disk tiers held to the issue-15 targets (the file tier is the baseline)."""


def block_layout(block_bytes: int) -> KVLayout:
    """The bench layout whose blocks are ``block_bytes`` long (a key of :data:`TOKENS_PER_BLOCK`)."""
    return KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=TOKENS_PER_BLOCK[block_bytes],
                    dtype="float16", model_id="bench-tiers")


def tier_openers(layout: KVLayout, root: Path, total: int, codec: str, results: Results) -> dict[str, Callable[[], Any]]:
    """Factories of the tiers that exist in this checkout; the others are recorded as skipped.

    LMDB and slab are capped at 1.25x ``total`` (the first fill fits, a second one evicts it: the
    steady-state put, ``<tier>.put_evicting``), the file tier at twice it."""
    cap = 2 * total + (256 << 20)
    tight = int(1.25 * total) + (16 << 20)
    out: dict[str, Callable[[], Any]] = {}
    try:
        from kvstore.tiers.host.tier import HostTier

        out["host"] = lambda: HostTier(layout, total + layout.bytes_per_block)
    except ImportError as exc:  # the tier is still being written
        results.skipped.setdefault("host", f"kvstore.tiers.host.tier not importable: {exc}")
    try:
        from kvstore.config.schema import DiskConfig
        from kvstore.tiers.lmdb.tier import DiskTier

        lmdb_cfg = DiskConfig(path=str(root / "lmdb"), max_size=tight, codec=codec)
        out["lmdb"] = lambda: DiskTier.from_config(lmdb_cfg, layout)
    except (ImportError, ValueError) as exc:  # not written yet, or its config section changed
        results.skipped.setdefault("lmdb", f"kvstore.tiers.lmdb.tier not usable: {exc}")
    try:
        from kvstore.config.schema import FileConfig
        from kvstore.tiers.file import FileTier

        file_cfg = FileConfig(path=str(root / "files"), max_size=cap, codec=codec)
        out["file"] = lambda: FileTier.from_config(file_cfg, layout)
    except (ImportError, ValueError) as exc:  # not written yet, or its config section changed
        results.skipped.setdefault("file", f"kvstore.tiers.file not usable: {exc}")
    if codec == "none":  # fixed-size slots: the slab tier stores the none codec only
        try:
            from kvstore.config.schema import SlabConfig
            from kvstore.tiers.slab.tier import SlabTier

            slab_cfg = SlabConfig(path=str(root / "slab"), max_size=tight)
            out["slab"] = lambda: SlabTier.from_config(slab_cfg, layout)
        except (ImportError, ValueError) as exc:  # not written yet, or its config section changed
            results.skipped.setdefault("slab", f"kvstore.tiers.slab.tier not usable: {exc}")
    return out


def _block_size(options: SuiteOptions, results: Results, bpb: int, total: int) -> None:
    layout = block_layout(bpb)
    n = total // bpb
    pool = kv_like_blocks(layout, max(1, min(n, POOL_BYTES // bpb)), options.seed)
    p = {"block_bytes": bpb, "total_bytes": n * bpb}
    limit = memcpy_gbps(n * bpb)
    results.add("memcpy", limit, "GB/s", **p)
    with scratch_dir(options) as root:
        raw = direct_io_gbps(root, n * bpb, parallel_request=bpb, parallel_threads=READ_THREADS, keep=True)
        raw_file = root / RAW_FILE

        def paired_limit() -> float:
            return best_parallel_read(raw_file, n * bpb, bpb, READ_THREADS)[0]

        results.add("raw.write", raw.write_gbps, "GB/s", mode=raw.mode, **p)
        results.add("raw.read", raw.read_gbps, "GB/s", mode=raw.mode, **p)
        par_read = raw.parallel_read_gbps or 0.0
        results.add("raw.read_parallel", par_read, "GB/s", mode=raw.mode, threads=raw.parallel_threads,
                    request_bytes=raw.parallel_request, **p)
        for name, open_tier in tier_openers(layout, root, n * bpb, "none", results).items():
            cold = None if name == "host" else root / name
            per_block = memcpy_per_block_gbps(n * bpb, bpb) if name == "host" else 0.0  # right before the host run
            host = name == "host"
            targeted = name in TARGETED
            if name == "lmdb":  # a page-cache writer: its limit on this machine, right before it
                buffered = buffered_write_gbps(root / "buffered.bench", n * bpb)
                results.add("raw.write_buffered", buffered, "GB/s", **p)
                for txn_bytes in TXN_SIZES:  # LMDB alone by transaction size (kvstore.tiers.lmdb.tier.TXN_BYTES)
                    results.add("lmdb_raw.put", lmdb_put_gbps(root, bpb, n * bpb, txn_bytes), "GB/s",
                                txn_bytes=txn_bytes, **p)
            t = run_tier(open_tier, pool, n, f"{name}/{bpb}", cold, prefault=host, evicting=host or targeted,
                         limit=paired_limit if targeted else None)
            results.add(f"{name}.put", t.put_gbps, "GB/s", **p)
            if host:
                assert t.put_evicting_gbps is not None
                results.add("host.get", t.get_gbps, "GB/s", **p)
                results.add("host.put_evicting", t.put_evicting_gbps, "GB/s", **p)
                results.add("memcpy.per_block", per_block, "GB/s", **p)
                for op, gbps in (("put", t.put_gbps), ("get", t.get_gbps), ("put_evicting", t.put_evicting_gbps)):
                    results.ratio(f"host.{op}/memcpy", gbps, limit, HOST_TARGET, **p)
                    results.ratio(f"host.{op}/memcpy.per_block", gbps, per_block, HOST_TARGET, **p)
                continue
            results.add(f"{name}.get_warm", t.warm_get_gbps, "GB/s", **p)
            results.add(f"{name}.get_cold", t.get_gbps, "GB/s", cold=t.cold_method, hits=t.hit_fraction, **p)
            results.ratio(f"{name}.put/raw.write", t.put_gbps, raw.write_gbps, TARGET_OF_LIMIT if targeted else None, **p)
            if name == "lmdb":
                results.ratio("lmdb.put/raw.write_buffered", t.put_gbps, buffered, **p)
            if t.put_evicting_gbps is not None:  # the full tier, each batch evicting the oldest (flush included)
                results.add(f"{name}.put_evicting", t.put_evicting_gbps, "GB/s", **p)
                results.ratio(f"{name}.put_evicting/raw.write", t.put_evicting_gbps, raw.write_gbps, **p)
            results.ratio(f"{name}.get_cold/raw.read", t.get_gbps, raw.read_gbps, **p)
            if t.limit_gbps is None:
                results.ratio(f"{name}.get_cold/raw.read_parallel", t.get_gbps, par_read, **p)
                continue
            # The target's denominator: the parallel read limit measured right before and after this cold get.
            results.add(f"raw.read_parallel.around_{name}", t.limit_gbps, "GB/s", mode=raw.mode, **p)
            results.ratio(f"{name}.get_cold/raw.read_parallel", t.get_gbps, t.limit_gbps, TARGET_OF_PARALLEL_READ,
                          paired="parallel read limit just before and after the cold get", **p)
            results.ratio(f"{name}.get_cold/raw.read_parallel.start", t.get_gbps, par_read, **p)
    if "lmdb.get_cold" in {f.name for f in results.figures} and "file.get_cold" in {f.name for f in results.figures}:
        results.ratio("lmdb.get_cold/file.get_cold", results.value("lmdb.get_cold", **p),
                      results.value("file.get_cold", **p), 1.0 if bpb <= SMALL_BLOCK else None, **p)


def _codecs(options: SuiteOptions, results: Results, total: int) -> None:
    layout = block_layout(CODEC_BLOCK)
    n = max(2, total // CODEC_BLOCK)
    pool = kv_like_blocks(layout, min(n, POOL_BYTES // CODEC_BLOCK), options.seed + 1)
    dest = pool[0].clone()
    for codec in CODECS:
        p = {"codec": codec, "block_bytes": CODEC_BLOCK, "data": "kv-like fp16 (synthetic)"}
        key = bytes(32)  # the key only feeds the checksum; one for all is as fast as any
        encoded = [encode(b, codec, 1, layout.fingerprint, layout.itemsize, key=key) for b in pool]
        t0 = time.perf_counter()
        for b in pool:
            encode(b, codec, 1, layout.fingerprint, layout.itemsize, key=key)
        t_enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        for v in encoded:
            decode_into(v, dest, layout.fingerprint, key)
        t_dec = time.perf_counter() - t0
        raw = pool.numel()
        results.add("codec.ratio", raw / sum(len(v) for v in encoded), "raw/stored", **p)
        results.add("codec.encode", raw / t_enc / 1e9, "GB/s", **p)
        results.add("codec.decode", raw / t_dec / 1e9, "GB/s", **p)
        with scratch_dir(options) as root:
            opener = tier_openers(layout, root, n * CODEC_BLOCK, codec, results).get("lmdb")
            if opener is not None:
                t = run_tier(opener, pool, n, f"codec/{codec}", root / "lmdb")
                results.add("lmdb.put", t.put_gbps, "GB/s", total_bytes=n * CODEC_BLOCK, **p)
                results.add("lmdb.get_cold", t.get_gbps, "GB/s", cold=t.cold_method, total_bytes=n * CODEC_BLOCK, **p)


def run(options: SuiteOptions, progress: Progress) -> Results:
    """Every block size, then the codecs."""
    sizes = QUICK_SIZES if options.quick else tuple(TOKENS_PER_BLOCK)
    total = (8 << 20) if options.quick else (512 << 20)
    results = Results("tiers", options, {
        "block_bytes": list(sizes), "total_bytes_per_run": total, "layout": "4 layers x 8 KV heads x 128, fp16",
        "batch_bytes": 32 << 20, "codec_level": 1, "lmdb_sync": "interval + flush() before the put is timed as done (slab: the same)",
        "get": "synchronous Tier.get in batches, one calling thread",
        "raw_read_parallel": f"O_DIRECT pread of block-size requests, best of {READ_THREADS} threads", "host_prefault": "arena filled and emptied once, untimed", "data": "kv-like fp16 (synthetic AR(1) per channel)",
    })
    progress.grow(len(sizes) + 1)
    for bpb in sizes:
        _block_size(options, results, bpb, total)
        progress.step(f"{bpb >> 10} KiB blocks")
    _codecs(options, results, total)
    progress.step("codecs")
    return results


def plot(results: Results, path: Path) -> None:
    """Bandwidth per block size for tiers and limits; codec ratio and bandwidth."""
    sizes = sorted({f.params["block_bytes"] for f in results.figures if f.name == "memcpy"})
    labels = [f"{s >> 10} KiB" for s in sizes]
    fig, axes = grid(3, "Tier bandwidth beside the machine's limit (same bytes, same run)")

    def series(names: list[str]) -> dict[str, list[float]]:
        out = {}
        for name in names:
            vals = [next((f.value for f in results.figures if f.name == name and f.params.get("block_bytes") == s
                          and "codec" not in f.params), float("nan")) for s in sizes]
            out[name] = vals
        return out

    grouped_bars(axes[0], labels, series(["memcpy", "memcpy.per_block", "host.put", "host.put_evicting", "host.get"]), "GB/s",
                 "host tier vs memcpy")
    grouped_bars(axes[1], labels, series(["raw.read_parallel", "raw.read", "lmdb.get_cold", "file.get_cold", "slab.get_cold",
                                          "raw.write", "raw.write_buffered", "lmdb.put", "file.put", "slab.put"]), "GB/s",
                 "disk tiers vs raw direct I/O (cold reads)")
    codec_figs = {c: [results.value(n, codec=c) if any(f.name == n and f.params.get("codec") == c
                                                         for f in results.figures) else float("nan")
                      for n in ("codec.encode", "codec.decode", "lmdb.get_cold")] for c in CODECS}
    grouped_bars(axes[2], ["encode", "decode", "LMDB cold get"], codec_figs, "GB/s",
                 "codecs at 1 MiB blocks (ratio: " + ", ".join(
                     f"{c} {results.value('codec.ratio', codec=c):.2f}x" for c in CODECS) + ")")
    axes[2].title.set_fontsize(8)
    save(fig, path)
