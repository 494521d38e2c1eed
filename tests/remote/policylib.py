"""Helpers for the remote write-policy tests: a CPU store over the store tests' layout with a remote tier of
:data:`G`-block groups, prompts, and the second-engine read-back."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
from remotelib import remote_tier

sys.path.insert(0, str(Path(__file__).parent.parent / "store"))
from storelib import LAYOUT, read_lease  # noqa: E402

from kvstore.config.schema import PolicyConfig  # noqa: E402
from kvstore.store.gpu_pool import GPUBlockPool  # noqa: E402
from kvstore.lower.remote_write import RemoteWrite  # noqa: E402
from kvstore.store.tiered import TieredStore  # noqa: E402
from kvstore.tiers.base import Tier  # noqa: E402
from kvstore.tiers.host.tier import HostTier  # noqa: E402

G = 4
"""Blocks per remote value."""
_prefixes = itertools.count()


def new_prefix(kind: str) -> str:
    """A Redis key prefix no other test in this process uses (the server is shared by a module)."""
    return f"{kind}{next(_prefixes)}:"


def policy_store(url: str, prefix: str, write: RemoteWrite, *, host: bool, hits: int = 2, gpu_blocks: int = 32,
                 disk: Tier | None = None, local: PolicyConfig | None = None) -> TieredStore:
    """A CPU store with remote groups of :data:`G` under ``prefix``; ``local``: the local tiers' policy (by default
    ``write_through``, what these tests were written against: every block on the local tiers from its commit)."""
    pool = GPUBlockPool(LAYOUT, gpu_blocks, device="cpu")
    host_tier = HostTier(LAYOUT, 32 * LAYOUT.bytes_per_block, auto_evict=False) if host else None
    remote = remote_tier(LAYOUT, url, group_blocks=G, key_prefix=prefix, listen_evictions=False)
    local = local or PolicyConfig(write="write_through")
    return TieredStore(LAYOUT, pool, host_tier, disk, local, remote=remote, remote_write=write,
                       remote_selective_hits=hits)


def prompt(n_blocks: int, seed: int) -> list[int]:
    """A prompt of ``n_blocks`` full blocks and one token more."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n_blocks * LAYOUT.block_size + 1,), generator=g).tolist()


def remote_blocks(store: TieredStore, toks: list[int]) -> int:
    """Blocks of ``toks``' prefix the remote tier holds, once the store's writes are done."""
    store.flush()
    assert store.h.remote is not None
    return store.h.remote.probe(store.keys(toks))


def loads_back(url: str, prefix: str, toks: list[int], data: list[torch.Tensor], blocks: int = 8) -> None:
    """A second store with an empty GPU and host reads ``blocks`` blocks back from Redis, bit-identical."""
    reader = policy_store(url, prefix, "read_only", host=True)
    got, lease = read_lease(reader, toks)
    assert lease.tokens_by_tier()["remote"] == len(got) * LAYOUT.block_size  # type: ignore[attr-defined]
    assert len(got) == blocks and all(torch.equal(g, d) for g, d in zip(got, data[:blocks]))
    reader.close()
