"""Disaggregated prefill through the store: a ``kv_producer`` vLLM computes prompts, a ``kv_consumer`` decodes.

The producer gets each prompt with ``max_tokens=1`` (as vLLM's disaggregated
prefill examples send it) and stores its blocks; the consumer, a separate
vLLM process on the same daemon, loads them and decodes. Roles are honoured:
the producer never loads (asked twice for a prompt it stored, it computes
it twice), the consumer never saves (the daemon receives no block bytes from it).
A router following the daemon's KV events (``kvstore route --store``) sees
the producer's blocks arrive, by tier, for the replica sharing the daemon.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import rig
from connectors.engine_keys import PromptKeys
from kvstore.layout import KVLayout
from kvstore.route.index import PrefixHit, RouterIndex
from kvstore.route.subscriber import EventSubscriber, StoreEndpoints
from prompts import Prompts
from rig import metric, tokens

BS = rig.BLOCK_SIZE


PORTS = (rig.free_port(), rig.free_port())
EVENTS, REPLAY = (f"tcp://127.0.0.1:{p}" for p in PORTS)


@pytest.fixture(scope="module")
def site(model: Path) -> Any:
    s = rig.Site.start(model, events={"enabled": True, "endpoint": EVENTS, "replay_endpoint": REPLAY,
                                      "interval_s": 0.02})
    yield s
    s.close()


@pytest.fixture(scope="module")
def router(site: rig.Site) -> Any:
    """A router index fed by the daemon's KV events, for replica ``r1`` (which shares the daemon)."""
    index = RouterIndex()
    index.add_replica("r1")
    sub = EventSubscriber(index, {}, stores={"daemon": StoreEndpoints(EVENTS, REPLAY, ("r1",))}, replay_timeout_s=5.0)
    sub.start()
    yield sub, index
    sub.close()


@pytest.fixture(scope="module")
def producer(model: Path, prompts: Prompts, site: rig.Site, router: Any) -> dict[str, Any]:
    return rig.run_engine(model, [
        {"prompts": [prompts.long, *prompts.turns], "max_tokens": 1},
        {"prompts": [prompts.long], "max_tokens": 1, "before": "reset_prefix_cache"},
    ], site.connector("kv_producer"))


@pytest.fixture(scope="module")
def consumer(model: Path, prompts: Prompts, site: rig.Site, producer: dict[str, Any]) -> dict[str, Any]:
    before = metric(site, "kvstore_block_bytes_in_total")
    record = rig.run_engine(model, [
        {"prompts": [prompts.long], "max_tokens": 12},
        {"prompts": prompts.turns, "max_tokens": 12},
        {"prompts": [prompts.other], "max_tokens": 12},
    ], site.connector("kv_consumer"))
    record["bytes_in"] = metric(site, "kvstore_block_bytes_in_total") - before
    return record


def test_a_producer_never_loads(producer: dict[str, Any]) -> None:
    assert producer["rounds"][1]["external_prefix_cache_hits"] == 0
    assert producer["rounds"][1]["prefix_cache_hits"] == 0


def test_the_consumer_decodes_what_the_producer_computed_equal_to_one_engine(
        consumer: dict[str, Any], reference: dict[str, Any], prompts: Prompts) -> None:
    rnd = consumer["rounds"][0]
    assert rnd["external_prefix_cache_hits"] == (len(prompts.long) - 1) // BS * BS  # every stored prompt block
    assert rnd["prompt_tokens"] - rnd["external_prefix_cache_hits"] < BS  # computes only the unstored tail
    assert tokens(consumer, 0) == tokens(reference, 0)
    assert tokens(consumer, 1) == tokens(reference, 1)


def test_a_consumer_never_saves(consumer: dict[str, Any], reference: dict[str, Any]) -> None:
    assert consumer["rounds"][2]["external_prefix_cache_hits"] == 0  # the producer never saw this prompt
    assert tokens(consumer, 2) == tokens(reference, 3)
    assert consumer["bytes_in"] == 0


def test_a_router_following_the_daemon_sees_the_producers_blocks_by_tier(model: Path, prompts: Prompts,
                                                                        producer: dict[str, Any], router: Any) -> None:
    import time

    sub, index = router
    layout = KVLayout(**rig.daemon_model(model))
    n = (len(prompts.long) - 1) // rig.BLOCK_SIZE
    keys = PromptKeys(layout, None).keys(prompts.long, n)
    deadline = time.monotonic() + 20
    while True:
        with sub.lock:
            hit = index.cached_prefix(keys)["r1"]
            tiers = index.tiers("daemon", keys[-1])
        if (hit.blocks == n and "disk" in tiers) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert hit == PrefixHit(n, {"host": n})  # counted for r1 in the fastest tier holding each block
    assert tiers == {"host", "disk"}  # the write-behind's disk copy is announced too


@pytest.fixture(scope="module")
def fleet(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two hosts' daemons (own data directories and sockets) sharing one Redis, every block sent (groups of 1)."""
    from benchmarks.redis_servers import redis_missing, start_server

    if (why := redis_missing()) is not None:
        pytest.fail(f"the fleet test needs redis-server: {why} (scripts/ensure_redis.sh installs it)")
    server = start_server(tmp_path_factory.mktemp("redis"))
    remote = {"url": server.url, "group_blocks": 1, "key_prefix": "pd:", "probe_timeout_s": 5.0}
    sites = [rig.Site.start(model, remote=remote), rig.Site.start(model, remote=remote)]
    yield sites
    for s in sites:
        s.close()
    server.stop()


def test_a_consumer_on_another_host_loads_the_producers_prompt_through_redis_equal_to_one_engine(
        model: Path, prompts: Prompts, fleet: list[rig.Site], reference: dict[str, Any]) -> None:
    rig.run_engine(model, [{"prompts": [prompts.long], "max_tokens": 1}], fleet[0].connector("kv_producer"))
    consumer = rig.run_engine(model, [{"prompts": [prompts.long], "max_tokens": 12}], fleet[1].connector("kv_consumer"))
    rnd = consumer["rounds"][0]
    n = (len(prompts.long) - 1) // BS
    assert rnd["external_prefix_cache_hits"] == n * BS  # every block the producer stored, from the other host
    assert rnd["prompt_tokens"] - rnd["external_prefix_cache_hits"] < BS  # computes only the unstored tail
    assert tokens(consumer, 0) == tokens(reference, 0)
    assert metric(fleet[1], "kvstore_hits_total", 'tier="remote"') == n  # all of it came over Redis
    assert metric(fleet[1], "kvstore_block_bytes_in_total") == 0  # the consumer saved nothing
