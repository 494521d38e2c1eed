"""The remote tier's write policies (``remote.write``) besides ``write_through``: ``write_through_selective``
stores a group once its last block was matched ``selective_hits`` times, ``write_back`` once one of its blocks
is about to leave the last local tier (the GPU, or the host tier with no disk); bad values are config errors."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from remotelib import remote_tier

sys.path.insert(0, str(Path(__file__).parent.parent / "store"))
from storelib import LAYOUT, prefill, read_lease  # noqa: E402

from kvstore.bench.redis_servers import RedisServer  # noqa: E402
from kvstore.config.loader import ConfigError, load_config  # noqa: E402
from kvstore.gpu_pool import GPUBlockPool  # noqa: E402
from kvstore.remote_writer import RemoteWrite  # noqa: E402
from kvstore.store import TieredStore  # noqa: E402
from kvstore.tiers.host import HostTier  # noqa: E402

G = 4
_prefixes = itertools.count()


def _store(url: str, prefix: str, write: RemoteWrite, *, host: bool, hits: int = 2, gpu_blocks: int = 32) -> TieredStore:
    pool = GPUBlockPool(LAYOUT, gpu_blocks, device="cpu")
    host_tier = HostTier(LAYOUT, 32 * LAYOUT.bytes_per_block, auto_evict=False) if host else None
    remote = remote_tier(LAYOUT, url, group_blocks=G, key_prefix=prefix, listen_evictions=False)
    return TieredStore(LAYOUT, pool, host_tier, None, remote=remote, remote_write=write, remote_selective_hits=hits)


def _tokens(n_blocks: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n_blocks * LAYOUT.block_size + 1,), generator=g).tolist()


def _remote_blocks(store: TieredStore, tokens: list[int]) -> int:
    store.flush()
    assert store.h.remote is not None
    return store.h.remote.probe(store.keys(tokens))


def _loads_back(url: str, prefix: str, tokens: list[int], data: list[torch.Tensor]) -> None:
    """A second store with an empty GPU and host reads the groups back from Redis, bit-identical."""
    reader = _store(url, prefix, "read_only", host=True)
    got, lease = read_lease(reader, tokens)
    assert lease.tokens_by_tier()["remote"] == len(got) * LAYOUT.block_size  # type: ignore[attr-defined]
    assert len(got) == 8 and all(torch.equal(g, d) for g, d in zip(got, data[:8]))
    reader.close()


@pytest.mark.parametrize("hits", [2, 3])
def test_selective_stores_a_group_once_matched_selective_hits_times(redis_server: RedisServer, hits: int) -> None:
    prefix = f"sel{next(_prefixes)}:"
    store = _store(redis_server.url, prefix, "write_through_selective", host=True, hits=hits)
    tokens = _tokens(10, seed=1)  # two full groups and a partial one
    data = prefill(store, tokens, seed=1)
    assert _remote_blocks(store, tokens) == 0  # committed, never matched: stays local
    for _ in range(hits - 1):
        store.lookup(tokens)
        assert _remote_blocks(store, tokens) == 0
    store.lookup(tokens)  # the hits-th match
    assert _remote_blocks(store, tokens) == 8
    store.lookup(tokens)
    store.flush()
    st = store.stats()["remote"]
    assert (st["groups_stored"], st["spilled_blocks"], st["skipped_groups"]) == (2, 8, 0)  # sent once, not per hit
    store.check_integrity()
    store.close()
    _loads_back(redis_server.url, prefix, tokens, data)


def test_selective_counts_the_last_block_of_each_group(redis_server: RedisServer) -> None:
    """A short prompt matching only the first group makes that group hot, not the second."""
    prefix = f"sel{next(_prefixes)}:"
    store = _store(redis_server.url, prefix, "write_through_selective", host=True, hits=2)
    tokens = _tokens(8, seed=2)
    prefill(store, tokens, seed=2)
    short = tokens[: G * LAYOUT.block_size + 1]
    store.lookup(short)
    store.lookup(short)
    assert _remote_blocks(store, tokens) == 4
    store.lookup(tokens)  # the second group's first match (the first group's third)
    assert _remote_blocks(store, tokens) == 4
    store.lookup(tokens)
    assert _remote_blocks(store, tokens) == 8
    store.close()


def test_write_back_below_the_gpu_stores_groups_only_when_evicted(redis_server: RedisServer) -> None:
    prefix = f"wb{next(_prefixes)}:"
    store = _store(redis_server.url, prefix, "write_back", host=False)
    tokens = _tokens(10, seed=3)
    data = prefill(store, tokens, seed=3)
    assert _remote_blocks(store, tokens) == 0  # committed: stays on the GPU
    assert store.offload("gpu") == 10  # no local tier below: evicted means gone from this store
    assert _remote_blocks(store, tokens) == 8  # the two full groups were handed down; the partial one is lost
    st = store.stats()
    assert (st["remote"]["groups_stored"], st["remote"]["skipped_groups"], st["index_blocks"]) == (2, 0, 0)
    store.check_integrity()
    store.close()
    _loads_back(redis_server.url, prefix, tokens, data)


def test_write_back_below_the_host_tier_waits_for_the_host_eviction(redis_server: RedisServer) -> None:
    prefix = f"wb{next(_prefixes)}:"
    store = _store(redis_server.url, prefix, "write_back", host=True)
    tokens = _tokens(8, seed=4)
    data = prefill(store, tokens, seed=4)
    store.offload("gpu")
    assert store.lookup(tokens).tiers == ("host",) * 8
    assert _remote_blocks(store, tokens) == 0  # left the GPU for the host tier: not yet
    assert store.offload("host") == 8
    assert _remote_blocks(store, tokens) == 8
    assert store.stats()["remote"]["groups_stored"] == 2  # each group once, though all of its blocks left
    store.check_integrity()
    store.close()
    _loads_back(redis_server.url, prefix, tokens, data)


def test_write_back_under_gpu_pressure_keeps_the_engine_going(redis_server: RedisServer) -> None:
    """Allocation that evicts (write_back copies the victims) succeeds, and the evicted prefix is remote."""
    prefix = f"wb{next(_prefixes)}:"
    store = _store(redis_server.url, prefix, "write_back", host=False, gpu_blocks=12)
    first, second = _tokens(8, seed=5), _tokens(8, seed=6)
    data = prefill(store, first, seed=5)
    prefill(store, second, seed=6)  # needs 8 of 12 blocks: evicts `first`'s tail first
    assert store.h.pool.num_used == 8 + 4
    store.offload("gpu")
    assert _remote_blocks(store, first) == 8 and _remote_blocks(store, second) == 8
    store.check_integrity()
    store.close()
    _loads_back(redis_server.url, prefix, first, data)


@pytest.mark.parametrize(("yaml", "needle"), [
    ("tiers: [host, remote]\nremote:\n  write: write_later\n", "remote.write"),
    ("tiers: [host, lmdb, remote]\nremote:\n  write: write_back\n", "remote.write: write_back with tiers"),
    ("tiers: [host, remote]\nremote:\n  write: write_through_selective\n  selective_hits: 0\n", "remote.selective_hits"),
])
def test_bad_remote_write_policies_name_the_field_and_the_file(tmp_path: Path, yaml: str, needle: str) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text(yaml)
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert str(path) in str(err.value) and needle in str(err.value)


def test_remote_write_policies_load_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text("tiers: [host, remote]\nremote:\n  write: write_through_selective\n  selective_hits: 5\n")
    cfg = load_config(path, environ={})
    assert (cfg.remote.write, cfg.remote.selective_hits) == ("write_through_selective", 5)
    path.write_text("tiers: [remote]\nremote:\n  write: write_back\n")
    assert load_config(path, environ={}).remote.write == "write_back"
