"""LMCache's real storage backends and token database timed on the ``peers`` suite's bytes and prompts.

Run under ``.venv-lmcache``'s python (LMCache 0.5.6, ``make venv-lmcache``).
Self-contained on purpose: it imports LMCache and nothing of kvstore. The
blocks are the suite's own: for every block size it reads ``pool-<bytes>.bin``
from ``--data`` (the KV-like blocks kvstore stores, written there by the
suite) and cycles through them. Per round it times:

- ``lmcache.disk.<mode>.put``: ``LocalDiskBackend.batched_submit_put_task``
  of ``--disk-bytes`` of blocks already in LMCache ``MemoryObj`` s (as its
  storage manager hands them over), until every write's completion callback
  ran, then ``os.sync()``: LMCache never fsyncs, so without it the put is not
  durable. ``mode`` is ``buffered`` (LMCache's default) or ``odirect``
  (``extra_config={"use_odirect": True}``: ``O_DIRECT`` writes and reads of
  block-aligned sizes, still followed by the sync for the files' metadata);
- ``lmcache.disk.<mode>.get`` / ``.batched_get``: cold reads of those blocks
  (page cache dropped, ``/proc/sys/vm/drop_caches``, before each) through
  ``get_blocking`` one key at a time and ``batched_get_blocking`` (its
  ``disk_io_threads`` = 4 readers);
- ``lmcache.cpu.put`` / ``.get``: ``LocalCPUBackend`` put = ``allocate`` (one
  per block, as ``LMCacheEngine.store`` does) + copy of the block into the
  ``MemoryObj`` + ``batched_submit_put_task``; get = ``get_blocking`` + copy
  out into a preallocated destination (the copies LMCache's connector does on
  each side of this tier; ``torch.copy_`` on one intra-op thread);
- ``lmcache.lookup``: ``ChunkedTokenDatabase.process_tokens`` of a cached
  prompt (256-token chunks, LMCache's default ``builtin`` hash) with
  ``LocalCPUBackend.contains`` per chunk until the first miss, the prompt
  drawn as in :mod:`kvstore.bench.lookup` (a sibling shares its first half).

Protocol (:mod:`benchmarks.peers.process`): one JSON line ``{"ready":
...}``, then one round per line read on stdin, printed as ``{"round": i,
"figures": [...]}``, each figure ``{"name", "block_bytes", "gbps"}`` or
``{"name", "prompt_tokens", "ms"}``; exits at end of input.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DISK_MODES = {"buffered": False, "odirect": True}
"""Disk mode -> LMCache's ``use_odirect``."""
CHUNK_TOKENS = 256
"""LMCache's default chunk size."""
PUT_TIMEOUT_S = 120.0
"""Longest wait for one block's write to complete."""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:  # needs root: checked before the ready line
        fh.write("3\n")


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _gbps(nbytes: int, fn: Callable[[], object]) -> float:
    return nbytes / _seconds(fn) / 1e9


def main(argv: list[str] | None = None) -> int:
    """Parse the options, import LMCache, and answer rounds (see the module docstring)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="directory with pool-<bytes>.bin; LMCache's files go here")
    ap.add_argument("--disk-sizes", type=_ints, default=[], help="block sizes of the disk rows, comma-separated")
    ap.add_argument("--host-sizes", type=_ints, default=[], help="block sizes of the host rows, comma-separated")
    ap.add_argument("--disk-bytes", type=int, default=128 << 20, help="bytes per disk put (rounded down to blocks)")
    ap.add_argument("--host-bytes", type=int, default=128 << 20, help="bytes per host put (rounded down to blocks)")
    ap.add_argument("--lengths", type=_ints, default=[], help="prompt lengths of the lookup row, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=5, help="timings of the lookup per round (the best is kept)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    import numpy as np
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat, MemoryObj
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
    from lmcache.v1.token_database import ChunkedTokenDatabase

    import_s = time.perf_counter() - t0
    # One copy per block: torch's intra-op threads only spin against each other on a small shared machine (0.05-4
    # GB/s, varying by 10x between rounds, with 2 on 2 loaded cores; 1.6-7 GB/s with 1). LMCache's own copies into
    # these buffers are its GPU connector's DMA, so the cheapest CPU copy is the fair stand-in.
    torch.set_num_threads(1)
    sizes = sorted(set(args.disk_sizes) | set(args.host_sizes))
    pools = {b: torch.from_numpy(np.fromfile(args.data / f"pool-{b}.bin", dtype=np.uint8).reshape(-1, b))
             for b in sizes}
    counts = {b: args.disk_bytes // b for b in args.disk_sizes}
    host_counts = {b: args.host_bytes // b for b in args.host_sizes}
    staging = max([args.disk_bytes, args.host_bytes]) * 2 + (64 << 20)
    disk_dir = args.data / "lmcache-disk"
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="lmcache-loop").start()

    def config(odirect: bool) -> Any:
        return LMCacheEngineConfig.from_defaults(chunk_size=CHUNK_TOKENS, local_cpu=True,
                                                 max_local_cpu_size=staging / 2**30, local_disk=str(disk_dir),
                                                 max_local_disk_size=2 * args.disk_bytes / 2**30 + 1,
                                                 extra_config={"use_odirect": odirect})

    meta = LMCacheMetadata(model_name="bench-peers", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.uint8, kv_shape=(1, 1, CHUNK_TOKENS, 1, 1),
                           chunk_size=CHUNK_TOKENS)
    cpu = LocalCPUBackend(config(False), meta)
    disks = {mode: LocalDiskBackend(config(odirect), loop, cpu, "cpu") for mode, odirect in DISK_MODES.items()}
    serial = iter(range(1 << 62))

    def keys(n: int) -> list[Any]:
        return [CacheEngineKey("bench-peers", 1, 0, next(serial), torch.uint8) for _ in range(n)]

    def filled(bpb: int, n: int) -> list[MemoryObj]:
        objs = []
        for i in range(n):
            obj = cpu.allocate(torch.Size([bpb]), torch.uint8, MemoryFormat.KV_2LTD)
            if obj is None:
                raise SystemExit(f"lmcache_storage: LocalCPUBackend could not allocate block {i} of {n}")
            obj.tensor.view(-1).copy_(pools[bpb][i % len(pools[bpb])])
            objs.append(obj)
        return objs

    def disk_run(mode: str, bpb: int) -> list[dict[str, Any]]:
        disk, n = disks[mode], counts[bpb]
        ks, objs = keys(n), filled(bpb, n)
        done = threading.Semaphore(0)

        def put() -> None:
            disk.batched_submit_put_task(ks, objs, on_complete_callback=lambda _k: done.release())
            for i in range(n):
                if not done.acquire(timeout=PUT_TIMEOUT_S):  # a write that raised in LMCache's worker never calls back
                    raise SystemExit(f"lmcache_storage: {mode} put: {n - i} of {n} writes did not complete")
            os.sync()  # LMCache writes without fsync; this is what makes the put durable

        out = [{"name": f"lmcache.disk.{mode}.put", "block_bytes": bpb, "gbps": _gbps(n * bpb, put)}]
        for obj in objs:
            obj.ref_count_down()
        for label, get in (("get", lambda: [disk.get_blocking(k) for k in ks]),
                           ("batched_get", lambda: disk.batched_get_blocking(ks))):
            _drop_page_cache()
            got: list[Any] = []
            out.append({"name": f"lmcache.disk.{mode}.{label}", "block_bytes": bpb,
                        "gbps": _gbps(n * bpb, lambda: got.extend(get()))})
            pool = pools[bpb]
            bad = [i for i, o in enumerate(got) if o is None or not torch.equal(o.tensor.view(-1), pool[i % len(pool)])]
            if bad:
                raise SystemExit(f"lmcache_storage: {mode} {label} returned {len(bad)} wrong blocks of {n}")
            for o in got:
                o.ref_count_down()
        for k in ks:
            disk.remove(k)
        return out

    def cpu_run(bpb: int) -> list[dict[str, Any]]:
        n = host_counts[bpb]
        ks, src = keys(n), pools[bpb]
        dest = torch.empty((n, bpb), dtype=torch.uint8)
        dest.fill_(1)  # fault the destination pages in before timing

        def put() -> None:
            objs = filled(bpb, n)
            cpu.batched_submit_put_task(ks, objs)
            for obj in objs:
                obj.ref_count_down()  # the caller's reference, as LMCache's storage manager drops it after a put

        def get() -> None:
            for i, k in enumerate(ks):
                obj = cpu.get_blocking(k)
                dest[i].copy_(obj.tensor.view(-1))
                obj.ref_count_down()

        out = [{"name": "lmcache.cpu.put", "block_bytes": bpb, "gbps": _gbps(n * bpb, put)},
               {"name": "lmcache.cpu.get", "block_bytes": bpb, "gbps": _gbps(n * bpb, get)}]
        if not torch.equal(dest[n - 1], src[(n - 1) % len(src)]):
            raise SystemExit("lmcache_storage: LocalCPUBackend returned a wrong block")
        for k in ks:
            cpu.remove(k)
        return out

    db = ChunkedTokenDatabase(config(False), meta)
    rng = np.random.default_rng(args.seed)
    prompts: dict[int, list[int]] = {}
    for n in args.lengths:  # the same draws, in the same order, as kvstore.bench.lookup
        tokens = rng.integers(0, 128_000, size=n, dtype=np.int64).tolist()
        sibling = tokens[: n // 2] + rng.integers(0, 128_000, size=n - n // 2).tolist()
        for t in (sibling, tokens):
            for _s, _e, key in db.process_tokens(t):
                if not cpu.contains(key):  # a placeholder block: the lookup reads only the keys
                    obj = cpu.allocate(torch.Size([8]), torch.uint8, MemoryFormat.KV_2LTD)
                    cpu.submit_put_task(key, obj)
                    obj.ref_count_down()
        prompts[n] = tokens

    def lookup(tokens: list[int]) -> int:
        hit = 0
        for _s, end, key in db.process_tokens(tokens):
            if not cpu.contains(key):
                break
            hit = end
        return hit

    def check_lookup() -> None:  # also after every round: an eviction of a prompt's chunk would time a short lookup
        for n, tokens in prompts.items():
            if lookup(tokens) != n // CHUNK_TOKENS * CHUNK_TOKENS:
                raise SystemExit(f"lmcache_storage: LMCache matched {lookup(tokens)} of {n} tokens")

    check_lookup()
    for bpb in args.host_sizes:  # first touch of the allocator's pages, untimed
        cpu_run(bpb)
    if args.disk_sizes:
        try:
            _drop_page_cache()
        except OSError as exc:  # before the ready line, so that the suite skips this peer with the reason
            raise SystemExit(f"lmcache_storage: cold reads need /proc/sys/vm/drop_caches (root): {exc}") from exc

    def one_round(i: int) -> dict[str, Any]:
        figures: list[dict[str, Any]] = []
        for bpb in args.disk_sizes:
            for mode in DISK_MODES:
                figures += disk_run(mode, bpb)
        for bpb in args.host_sizes:
            figures += cpu_run(bpb)
        for n, tokens in prompts.items():
            figures.append({"name": "lmcache.lookup", "prompt_tokens": n,
                            "ms": min(_seconds(lambda: lookup(tokens)) for _ in range(args.repeat)) * 1e3})
        check_lookup()
        return {"round": i, "figures": figures}

    print(json.dumps({"ready": True, "lmcache": importlib.metadata.version("lmcache"),
                      "python": sys.version.split()[0], "import_s": round(import_s, 2),
                      "disk_io_threads": 4, "chunk_tokens": CHUNK_TOKENS, "torch_threads": torch.get_num_threads()}),
          flush=True)
    try:
        for i, _line in enumerate(sys.stdin):
            print(json.dumps(one_round(i)), flush=True)
    finally:
        for disk in disks.values():
            disk.close()
        loop.call_soon_threadsafe(loop.stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
