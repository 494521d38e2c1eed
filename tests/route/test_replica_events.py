"""``kvstore engine serve``'s events: off unless asked, the flags override the config and are checked."""

from __future__ import annotations

import time

import pytest

from connectors.embedded import EmbeddedConnector
from kvstore.cli.replica_events import ReplicaEvents
from kvstore.config.schema import KVStoreConfig
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout


def _connector() -> tuple[KVStoreConfig, EmbeddedConnector]:
    cfg = KVStoreConfig.model_validate({"tiers": []})
    connector = EmbeddedConnector(cfg)
    connector.register(GPUBlockPool(KVLayout(1, 1, 4, 4, "float32", model_id="t"), 8, "cpu"))
    return cfg, connector


def test_events_are_off_unless_the_config_or_a_flag_turns_them_on() -> None:
    cfg, connector = _connector()
    events = ReplicaEvents.start(cfg, connector, "r", None, None)
    assert events.publisher is None and events.stats() == {"events": {"enabled": False}} and events.banner() == ""
    connector.close()


def test_the_endpoint_flag_enables_events_and_the_first_batch_is_all_cleared() -> None:
    cfg, connector = _connector()
    before = time.time_ns() // 1000
    events = ReplicaEvents.start(cfg, connector, "r", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    try:
        stats = events.stats()["events"]
        # One batch so far, numbered from the start time in microseconds (a restart's seqs never repeat).
        assert stats["enabled"] is True and before <= stats["last_seq"] <= time.time_ns() // 1000
        assert stats["endpoint"].startswith("tcp://127.0.0.1:") and not stats["endpoint"].endswith(":0")
        assert events.banner() == f"; KV events on {stats['endpoint']}, replay on {stats['replay_endpoint']}"
    finally:
        events.close()
        connector.close()


def test_a_bad_endpoint_flag_is_refused_naming_the_flag() -> None:
    cfg, connector = _connector()
    with pytest.raises(ValueError, match=r"--events-endpoint/--replay-endpoint: endpoint: .*is not a ZMQ address"):
        ReplicaEvents.start(cfg, connector, "r", "localhost:5557", None)
    connector.close()
