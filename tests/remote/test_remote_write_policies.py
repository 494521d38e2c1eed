"""The remote tier's write policies (``remote.write``) besides ``write_through``: ``write_through_selective``
stores a group once its last block was matched ``selective_hits`` times, ``write_back`` once one of its blocks
is about to leave the last local tier (the GPU, the host tier with no disk, or the disk tier: see
``test_remote_write_back_disk.py``); bad values are config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from policylib import G, loads_back, new_prefix, policy_store, prompt, remote_blocks
from storelib import LAYOUT, prefill

from benchmarks.redis_servers import RedisServer
from kvstore.config.loader import ConfigError, load_config


@pytest.mark.parametrize("hits", [2, 3])
def test_selective_stores_a_group_once_matched_selective_hits_times(redis_server: RedisServer, hits: int) -> None:
    prefix = new_prefix("sel")
    store = policy_store(redis_server.url, prefix, "write_through_selective", host=True, hits=hits)
    tokens = prompt(10, seed=1)  # two full groups and a partial one
    data = prefill(store, tokens, seed=1)
    assert remote_blocks(store, tokens) == 0  # committed, never matched: stays local
    for _ in range(hits - 1):
        store.lookup(tokens)
        assert remote_blocks(store, tokens) == 0
    store.lookup(tokens)  # the hits-th match
    assert remote_blocks(store, tokens) == 8
    store.lookup(tokens)
    store.flush()
    st = store.stats()["remote"]
    assert (st["groups_stored"], st["spilled_blocks"], st["skipped_groups"]) == (2, 8, 0)  # sent once, not per hit
    store.check_integrity()
    store.close()
    loads_back(redis_server.url, prefix, tokens, data)


def test_selective_counts_the_last_block_of_each_group(redis_server: RedisServer) -> None:
    """A short prompt matching only the first group makes that group hot, not the second."""
    prefix = new_prefix("sel")
    store = policy_store(redis_server.url, prefix, "write_through_selective", host=True, hits=2)
    tokens = prompt(8, seed=2)
    prefill(store, tokens, seed=2)
    short = tokens[: G * LAYOUT.block_size + 1]
    store.lookup(short)
    store.lookup(short)
    assert remote_blocks(store, tokens) == 4
    store.lookup(tokens)  # the second group's first match (the first group's third)
    assert remote_blocks(store, tokens) == 4
    store.lookup(tokens)
    assert remote_blocks(store, tokens) == 8
    store.close()


def test_write_back_below_the_gpu_stores_groups_only_when_evicted(redis_server: RedisServer) -> None:
    prefix = new_prefix("wb")
    store = policy_store(redis_server.url, prefix, "write_back", host=False)
    tokens = prompt(10, seed=3)
    data = prefill(store, tokens, seed=3)
    assert remote_blocks(store, tokens) == 0  # committed: stays on the GPU
    assert store.offload("gpu") == 10  # no local tier below: evicted means gone from this store
    assert remote_blocks(store, tokens) == 8  # the two full groups were handed down; the partial one is lost
    st = store.stats()
    assert (st["remote"]["groups_stored"], st["remote"]["skipped_groups"], st["index_blocks"]) == (2, 0, 0)
    store.check_integrity()
    store.close()
    loads_back(redis_server.url, prefix, tokens, data)


def test_write_back_below_the_host_tier_waits_for_the_host_eviction(redis_server: RedisServer) -> None:
    prefix = new_prefix("wb")
    store = policy_store(redis_server.url, prefix, "write_back", host=True)
    tokens = prompt(8, seed=4)
    data = prefill(store, tokens, seed=4)
    store.offload("gpu")
    assert store.lookup(tokens).tiers == ("host",) * 8
    assert remote_blocks(store, tokens) == 0  # left the GPU for the host tier: not yet
    assert store.offload("host") == 8
    assert remote_blocks(store, tokens) == 8
    assert store.stats()["remote"]["groups_stored"] == 2  # each group once, though all of its blocks left
    store.check_integrity()
    store.close()
    loads_back(redis_server.url, prefix, tokens, data)


def test_write_back_under_gpu_pressure_keeps_the_engine_going(redis_server: RedisServer) -> None:
    """Allocation that evicts (write_back copies the victims) succeeds, and the evicted prefix is remote."""
    prefix = new_prefix("wb")
    store = policy_store(redis_server.url, prefix, "write_back", host=False, gpu_blocks=12)
    first, second = prompt(8, seed=5), prompt(8, seed=6)
    data = prefill(store, first, seed=5)
    prefill(store, second, seed=6)  # needs 8 of 12 blocks: evicts `first`'s tail first
    assert store.h.pool.num_used == 8 + 4
    store.offload("gpu")
    assert remote_blocks(store, first) == 8 and remote_blocks(store, second) == 8
    store.check_integrity()
    store.close()
    loads_back(redis_server.url, prefix, first, data)


@pytest.mark.parametrize(("yaml", "needle"), [
    ("tiers: [host, remote]\nremote:\n  write: write_later\n", "remote.write"),
    ("tiers: [host, lmdb, remote]\nremote:\n  write: write_later\n", "remote.write"),
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
    for tiers in ("[remote]", "[host, remote]", "[host, lmdb, remote]", "[lmdb, remote]", "[host, file, remote]"):
        path.write_text(f"tiers: {tiers}\nremote:\n  write: write_back\n")  # the disk tier hands its victims down
        assert load_config(path, environ={}).remote.write == "write_back", tiers


@pytest.mark.parametrize("disk", ["lmdb", "file", "slab"])
def test_write_back_below_every_disk_tier_is_accepted(tmp_path: Path, disk: str) -> None:
    """Each disk tier shows its victims to the remote writer, so write_back is valid below any of them."""
    path = tmp_path / "kv.yaml"
    path.write_text(f"tiers: [host, {disk}, remote]\nremote:\n  write: write_back\n")
    cfg = load_config(path, environ={})
    assert cfg.tiers == ["host", disk, "remote"] and cfg.remote.write == "write_back"
