"""The tiered store with a remote tier below its local ones: groups written as they fill, a second store
with empty GPU, host and disk loads a prefix from Redis (promoted to host and GPU), failures are shortfalls."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import torch
from remotelib import remote_tier

sys.path.insert(0, str(Path(__file__).parent.parent / "store"))
from storelib import LAYOUT, MemoryTier, fill, prefill, read_lease  # noqa: E402

from benchmarks.redis_servers import RedisServer, start_server  # noqa: E402
from kvstore.config.schema import PolicyConfig  # noqa: E402
from kvstore.store.gpu_pool import GPUBlockPool  # noqa: E402
from kvstore.store.tiered import TieredStore  # noqa: E402
from kvstore.tiers.host.tier import HostTier  # noqa: E402

G = 4
_prefixes = itertools.count()


def _store(url: str, prefix: str, *, disk: bool = False, host: bool = True, write: bool = True, **policy: Any) -> TieredStore:
    """A CPU store over the remote tier (``write``: the remote is written through, else read only); the local
    tiers ``write_through`` unless ``policy`` says (inclusive: a promoted block is on the GPU and in host)."""
    policy.setdefault("write", "write_through")
    pool = GPUBlockPool(LAYOUT, 32, device="cpu")
    host_tier = HostTier(LAYOUT, 32 * LAYOUT.bytes_per_block, auto_evict=False) if host else None
    remote = remote_tier(LAYOUT, url, group_blocks=G, key_prefix=prefix, listen_evictions=False)
    return TieredStore(LAYOUT, pool, host_tier, MemoryTier(LAYOUT) if disk else None, PolicyConfig(**policy),
                       remote=remote, remote_write="write_through" if write else "read_only")


def _tokens(n_blocks: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n_blocks * LAYOUT.block_size + 1,), generator=g).tolist()


def test_groups_go_remote_once_their_last_block_is_committed(redis_server: RedisServer) -> None:
    prefix = f"store{next(_prefixes)}:"
    store = _store(redis_server.url, prefix)
    assert store.h.remote is not None
    tokens = _tokens(10, seed=1)
    keys = store.keys(tokens)
    blocks = store.allocate(10)
    fill(store, blocks, seed=1)
    store.commit(keys[:6], blocks[:6], tokens[: 6 * LAYOUT.block_size])  # group 0 full, group 1 half
    store.flush()
    assert store.h.remote.probe(keys) == 4 and store.stats()["remote"]["spilled_blocks"] == 4
    store.commit(keys, blocks, tokens[: 10 * LAYOUT.block_size])  # as the engine does: the chain from its start
    store.flush()
    assert store.h.remote.probe(keys) == 8 and store.stats()["remote"]["spilled_blocks"] == 8
    assert store.stats()["remote"]["groups_stored"] == 2  # block 8, 9: a partial group stays local
    assert store.stats()["remote"]["skipped_groups"] == 0
    store.free(blocks)
    store.check_integrity()
    store.close()


def test_an_empty_store_loads_the_prefix_from_redis_and_promotes_it(redis_server: RedisServer) -> None:
    prefix = f"store{next(_prefixes)}:"
    writer = _store(redis_server.url, prefix, disk=True)
    tokens = _tokens(9, seed=2)
    data = prefill(writer, tokens, seed=2)
    writer.flush()
    writer.close()
    reader = _store(redis_server.url, prefix, disk=True, write=False)
    m = reader.lookup(tokens)
    assert m.tiers == ("remote",) * 8  # two full groups; block 8 was never remote
    got, lease = read_lease(reader, tokens)
    assert len(got) == 8 and all(torch.equal(g, d) for g, d in zip(got, data[:8]))
    assert lease.tokens_by_tier() == {"gpu": 0, "host": 0, "disk": 0, "remote": 32}  # type: ignore[attr-defined]
    st = reader.stats()
    assert st["remote"]["hit_tokens"] == 2 * 32 and st["remote"]["loaded_blocks"] == 8 and st["remote"]["hits"] == 8  # two lookups: the one above and read_lease's
    again = reader.lookup(tokens)
    assert again.tiers == ("gpu",) * 8  # promoted: indexed on the GPU (and host) now
    with reader.lock:
        assert all(reader.index.get(k).host_slot is not None for k in again.keys)  # type: ignore[union-attr]
    reader.check_integrity()
    reader.close()


def test_read_only_remote_writes_nothing(redis_server: RedisServer) -> None:
    prefix = f"store{next(_prefixes)}:"
    store = _store(redis_server.url, prefix, write=False)
    tokens = _tokens(8, seed=3)
    prefill(store, tokens, seed=3)
    store.flush()
    assert store.h.remote is not None and store.h.remote.probe(store.keys(tokens)) == 0
    store.close()


def test_redis_gone_between_lookup_and_load_is_a_shortfall_not_an_error(tmp_path: Path) -> None:
    server = start_server(tmp_path / "gone")
    writer = _store(server.url, "gone:")
    tokens = _tokens(8, seed=4)
    prefill(writer, tokens, seed=4)
    writer.flush()
    writer.close()
    reader = _store(server.url, "gone:", write=False)
    m = reader.lookup(tokens)
    assert m.tiers == ("remote",) * 8
    server.stop()
    lease = reader.acquire(m)
    assert lease.resolve() == 0 and lease.shortfall is not None and "remote tier returned 0 of" in lease.shortfall
    reader.release(lease)
    assert reader.lookup(tokens).num_blocks == 0  # the tier is down: a miss, not an error
    st = reader.stats()["remote"]
    assert st["errors"] >= 1 and st["hits"] == 0
    reader.check_integrity()
    reader.close()
