"""A real TieredStore publishing its events (``events:``): the router's keys and tiers match the store's,
and a router that fell behind recovers from the store's full report."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from connectors.embedded import EmbeddedConnector
from kvstore.config.events import EventsConfig
from kvstore.config.schema import KVStoreConfig, PolicyConfig
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.hashing import block_keys
from kvstore.layout import KVLayout
from kvstore.route.index import PrefixHit, RouterIndex
from kvstore.route.publisher import EventPublisher, attach_publisher
from kvstore.route.subscriber import EventSubscriber, ReplicaEndpoints
from kvstore.store.tiered import TieredStore
from kvstore.tiers.host.tier import HostTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16", model_id="route-test")
BS = LAYOUT.block_size


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def _events_cfg(buffer_batches: int = 1000) -> EventsConfig:
    return EventsConfig(enabled=True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                        replica_id="r1", interval_s=0.01, buffer_batches=buffer_batches)


def _prefill(store: TieredStore, tokens: list[int]) -> list[bytes]:
    keys = store.keys(tokens)
    blocks = store.allocate(len(keys))
    for b in blocks:
        store.pool.block(b).copy_(torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype))
    store.commit(keys, blocks, tokens)
    store.free(blocks)
    return keys


@pytest.fixture
def store() -> Iterator[TieredStore]:
    pool = GPUBlockPool(LAYOUT, 8, device="cpu")
    s = TieredStore(LAYOUT, pool, HostTier(LAYOUT, 8 * LAYOUT.bytes_per_block, auto_evict=False), None,
                    PolicyConfig(write="write_back"))
    yield s
    s.close()


def _follow(pub: EventPublisher) -> EventSubscriber:
    sub = EventSubscriber(RouterIndex(), {"r1": ReplicaEndpoints(pub.endpoint, pub.replay_endpoint)})
    sub.start()
    assert pub.wait_for_subscribers(1)
    return sub


def _prefix(sub: EventSubscriber, keys: list[bytes]) -> PrefixHit:
    with sub.lock:
        return sub.index.cached_prefix(keys)["r1"]


def _held(sub: EventSubscriber, replica: str, keys: list[bytes]) -> int:
    with sub.lock:
        return sub.index.cached_prefix(keys)[replica].blocks


def test_router_keys_match_the_stores_and_tiers_follow_offload(store: TieredStore) -> None:
    pub = attach_publisher(store, _events_cfg())
    sub = _follow(pub)
    try:
        tokens = list(range(3 * BS + 1))
        stored = _prefill(store, tokens)
        router_keys = block_keys(tokens, LAYOUT)  # the router hashes the prompt itself
        assert router_keys == stored
        wait_until(lambda: _prefix(sub, router_keys) == PrefixHit(3, {"gpu": 3}))
        assert store.offload("gpu") == 3
        wait_until(lambda: _prefix(sub, router_keys) == PrefixHit(3, {"host": 3}))
        with sub.lock:
            assert sub.index.tiers("r1", router_keys[0]) == {"host"}
    finally:
        sub.close()
        pub.close()


def test_a_router_behind_the_replay_window_gets_the_stores_full_report(store: TieredStore) -> None:
    pub = attach_publisher(store, _events_cfg(buffer_batches=1))
    keys = _prefill(store, list(range(2 * BS)))
    pub.pump()
    store.offload("gpu")
    keys += _prefill(store, list(range(100, 100 + 2 * BS)))
    pub.pump()  # the router missed all of these and only the last batch is still buffered
    sub = _follow(pub)
    try:
        keys2 = _prefill(store, list(range(200, 200 + BS)))
        wait_until(lambda: _prefix(sub, keys2) == PrefixHit(1, {"gpu": 1}))
        f = sub.feeds["r1"]
        assert (f.gaps, f.replays, f.full_reports) == (1, 0, 1)
        assert _prefix(sub, keys[:2]) == PrefixHit(2, {"host": 2})
        assert _prefix(sub, keys[2:]) == PrefixHit(2, {"gpu": 2})  # the second prompt's own chain
        with sub.lock:
            assert sub.index.tiers("r1", keys[2]) == {"gpu"} and sub.index.blocks("r1") == 5
    finally:
        sub.close()
        pub.close()


def test_the_embedded_connector_publishes_when_events_are_enabled() -> None:
    cfg = KVStoreConfig(tiers=[], events=_events_cfg())
    conn = EmbeddedConnector(cfg)
    conn.register(GPUBlockPool(LAYOUT, 8, device="cpu"))
    pub = conn._events  # noqa: SLF001 - the connector's publisher, to follow it
    assert pub is not None and pub.replica == "r1"
    sub = _follow(pub)
    try:
        keys = _prefill(conn.store, list(range(2 * BS)))
        wait_until(lambda: _prefix(sub, keys) == PrefixHit(2, {"gpu": 2}))
    finally:
        sub.close()
        conn.close()
    assert conn._events is None  # noqa: SLF001 - closed with the connector
    assert EmbeddedConnector(KVStoreConfig(tiers=[]))._events is None  # noqa: SLF001 - off by default


def test_three_stores_a_chat_each_later_turn_goes_to_the_replica_holding_its_history() -> None:
    """Three real stores publishing, one router: keys by kvstore's hash, RouterIndex + CostPolicy; every later
    turn is routed where its history is, and that store's own lookup confirms the cached tokens."""
    from kvstore.route.policy import CostPolicy, ReplicaLoad

    stores, pubs = {}, {}
    for i in range(3):
        pool = GPUBlockPool(LAYOUT, 64, device="cpu")
        stores[f"r{i}"] = TieredStore(LAYOUT, pool, None, None, PolicyConfig(write="write_back"))
        cfg = _events_cfg()
        cfg.replica_id = f"r{i}"
        pubs[f"r{i}"] = attach_publisher(stores[f"r{i}"], cfg)
    sub = EventSubscriber(RouterIndex(), {n: ReplicaEndpoints(p.endpoint, p.replay_endpoint) for n, p in pubs.items()})
    sub.start()
    try:
        for p in pubs.values():
            assert p.wait_for_subscribers(1)
        policy = CostPolicy.for_block_size(BS)
        loads = {n: ReplicaLoad() for n in stores}
        chats = {c: list(range(1000 * c, 1000 * c + 2 * BS)) for c in (1, 2, 3)}
        home: dict[int, str] = {}
        for turn in range(3):
            for c, history in chats.items():
                keys = block_keys(history, LAYOUT)
                with sub.lock:
                    decision = policy.choose(len(keys), sub.index.cached_prefix(keys), loads)
                name = decision.replica
                if turn == 0:
                    assert decision.hit.blocks == 0
                    home[c] = name
                    loads[name].in_flight_requests += 1  # a chat stays in flight: the next new one goes elsewhere
                else:
                    assert name == home[c]
                    assert decision.hit.blocks == len(history) // BS - 2  # the previous turn's blocks
                    assert stores[name].lookup(history).num_tokens == decision.hit.blocks * BS
                _prefill(stores[name], history)
                want = len(history) // BS
                wait_until(lambda: _held(sub, name, keys) == want)  # noqa: B023 - read while this turn runs
                history += list(range(50_000 + 100 * c + 10 * turn, 50_000 + 100 * c + 10 * turn + 2 * BS))
        assert sorted(home.values()) == ["r0", "r1", "r2"]
    finally:
        sub.close()
        for n, p in pubs.items():
            p.close()
            stores[n].close()
