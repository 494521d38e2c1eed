"""The ``events:`` section: off by default, and a bad value is an error naming the file and the field."""

from __future__ import annotations

import pytest

from kvstore.config import ConfigError, parse_config


def test_events_are_off_by_default_and_set_from_yaml_or_env() -> None:
    assert parse_config({}).events.enabled is False
    cfg = parse_config({"events": {"enabled": True, "endpoint": "ipc:///tmp/ev", "replica_id": "engine-0"}},
                       "r.yaml", {"KVSTORE_EVENTS__BUFFER_BATCHES": "50"})
    assert (cfg.events.enabled, cfg.events.endpoint, cfg.events.replica_id, cfg.events.buffer_batches) == \
        (True, "ipc:///tmp/ev", "engine-0", 50)


@pytest.mark.parametrize(("events", "says"), [
    ({"endpoint": "localhost:5557"}, "events.endpoint"),
    ({"replay_endpoint": "http://x"}, "events.replay_endpoint"),
    ({"buffer_batches": 0}, "events.buffer_batches"),
    ({"enable": True}, "events.enable"),
])
def test_a_bad_events_value_names_the_file_and_field(events: dict, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"events": events}, "replica.yaml")
    assert "replica.yaml" in str(info.value) and says in str(info.value)
