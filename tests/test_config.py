"""Config: YAML loading, env overrides, clear errors, the CLI check, the documented default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvstore.config import ConfigError, KVStoreConfig, load_config, parse_config
from kvstore.config.render import render_default_yaml


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, env=env, timeout=120)


def test_default_yaml_is_valid_and_equals_builtin_defaults(repo: Path) -> None:
    cfg = load_config(repo / "configs/default.yaml", environ={})
    assert cfg == KVStoreConfig()


def test_default_yaml_documents_every_field(repo: Path) -> None:
    text = (repo / "configs/default.yaml").read_text()
    assert text == render_default_yaml(), "configs/default.yaml is stale: regenerate with `kvstore config default`"
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            assert lines[i - 1].strip().startswith("#"), f"field without a comment: {line!r}"


def test_every_shipped_config_is_valid(repo: Path) -> None:
    paths = sorted((repo / "configs").rglob("*.yaml"))
    assert len(paths) >= 5
    for path in paths:
        load_config(path, environ={})


def test_test_yaml_is_valid(repo: Path) -> None:
    cfg = load_config(repo / "configs/test.yaml", environ={})
    assert cfg.model.block_size == 4 and cfg.host.capacity == 64 * 1024


def test_sizes_accept_units() -> None:
    cfg = parse_config({"host": {"capacity": "4GiB"}, "disk": {"max_size": "512MB"}, "file": {"max_size": 1234}})
    assert cfg.host.capacity == 4 * 2**30
    assert cfg.disk.max_size == 512 * 10**6
    assert cfg.file.max_size == 1234


def test_env_override_applies_and_is_typed() -> None:
    env = {"KVSTORE_DISK__MAX_SIZE": "1GiB", "KVSTORE_GPU__NUM_BLOCKS": "77", "KVSTORE_HOST__SHARED_MEMORY": "true"}
    cfg = parse_config({"disk": {"max_size": "2GiB"}}, "f.yaml", env)
    assert cfg.disk.max_size == 2**30
    assert cfg.gpu.num_blocks == 77
    assert cfg.host.shared_memory is True


def test_env_override_error_names_variable() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({}, "f.yaml", {"KVSTORE_GPU__NUM_BLOCKS": "many"})
    assert "gpu.num_blocks" in str(info.value) and "KVSTORE_GPU__NUM_BLOCKS" in str(info.value)


def test_hold_timeout_accepts_its_deprecated_name_lease_timeout() -> None:
    assert parse_config({"daemon": {"hold_timeout_s": 6}}, "f.yaml").daemon.hold_timeout_s == 6.0
    assert parse_config({"daemon": {"lease_timeout_s": 5}}, "f.yaml").daemon.hold_timeout_s == 5.0
    assert parse_config({}, "f.yaml", {"KVSTORE_DAEMON__LEASE_TIMEOUT_S": "7"}).daemon.hold_timeout_s == 7.0
    with pytest.raises(ConfigError, match=r"daemon\.lease_timeout_s: Input should be greater than 0"):
        parse_config({"daemon": {"lease_timeout_s": 0}}, "f.yaml")


def test_unknown_env_field_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'disk.max_sise'.*did you mean 'disk.max_size'"):
        parse_config({}, "f.yaml", {"KVSTORE_DISK__MAX_SISE": "1GiB"})


def test_all_problems_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"disk": {"max_size": -1, "codec": "lz4"}, "gpu": {"num_blocks": 0}, "typo": 1}, "f.yaml")
    problems = info.value.problems
    assert len(problems) == 4
    text = "\n".join(problems)
    for needle in ("disk.max_size", "cannot be negative", "disk.codec", "'shuffle_zstd'", "gpu.num_blocks", "'typo'"):
        assert needle in text


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file") as info:
        load_config(tmp_path / "nope.yaml", environ={})
    assert "nope.yaml" in str(info.value)


def test_bad_yaml_names_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("disk:\n  path: [unclosed\n")
    with pytest.raises(ConfigError, match=r"not valid YAML: line \d+, column \d+"):
        load_config(p, environ={})


def test_wrong_type_and_non_mapping(tmp_path: Path) -> None:
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(p, environ={})
    with pytest.raises(ConfigError, match=r"disk: Input should be a valid dictionary"):
        parse_config({"disk": 5})
    with pytest.raises(ConfigError, match=r"host.shared_memory"):
        parse_config({"host": {"shared_memory": "perhaps"}})


def test_a_removed_field_names_what_replaced_it(tmp_path: Path) -> None:
    p = tmp_path / "old.yaml"
    p.write_text("host:\n  shm_name: kvstore-mine\n")
    with pytest.raises(ConfigError) as err:
        load_config(p, environ={})
    message = str(err.value)
    assert str(p) in message and "'host.shm_name' was removed: the daemon's shared arena has no name" in message
    assert "unknown key" not in message
    with pytest.raises(ConfigError, match=r"unknown key 'host.shm_nam'"):  # a key that never existed: as before
        parse_config({"host": {"shm_nam": "x"}})


def test_tiers_by_name() -> None:
    assert parse_config({"tiers": ["host", "file"]}).tiers == ["host", "file"]
    assert parse_config({"tiers": []}).tiers == []
    assert parse_config({"tiers": ["host", "slab"]}).tiers == ["host", "slab"]
    with pytest.raises(ConfigError, match=r"tiers.0: Input should be 'host', 'lmdb', 'file', 'slab' or 'remote'"):
        parse_config({"tiers": ["nvme"]})
    with pytest.raises(ConfigError, match="one disk tier"):
        parse_config({"tiers": ["host", "lmdb", "file"]})
    with pytest.raises(ConfigError, match="one disk tier of lmdb, file, slab, not file and slab"):
        parse_config({"tiers": ["host", "file", "slab"]})
    with pytest.raises(ConfigError, match="'host' must come first"):
        parse_config({"tiers": ["lmdb", "host"]})


def test_remote_tier_order_and_url() -> None:
    cfg = parse_config({"tiers": ["host", "lmdb", "remote"], "remote": {"url": "redis-cluster://a:1,b:2", "group_blocks": 16}})
    assert cfg.tiers == ["host", "lmdb", "remote"] and cfg.remote.group_blocks == 16
    assert parse_config({"tiers": ["remote"]}).tiers == ["remote"]
    with pytest.raises(ConfigError, match="'remote' must come last"):
        parse_config({"tiers": ["host", "remote", "lmdb"]})
    with pytest.raises(ConfigError, match=r"remote.url: remote.url 'http://x:1': the scheme must be one of redis://, rediss://"):
        parse_config({"remote": {"url": "http://x:1"}})
    with pytest.raises(ConfigError, match=r"remote.url .* names no host"):
        parse_config({"remote": {"url": "redis:///0"}})
    with pytest.raises(ConfigError, match=r"remote.group_blocks"):
        parse_config({"remote": {"group_blocks": 0}})


def test_tcp_without_token_refused() -> None:
    with pytest.raises(ConfigError, match="token"):
        parse_config({"daemon": {"tcp_host": "0.0.0.0"}})


def test_cli_check_default_exits_zero(repo: Path) -> None:
    res = _cli("config", "check", str(repo / "configs/default.yaml"))
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(res.stdout)["disk"]["max_size"] == "8GiB"


def test_cli_check_bogus_key_exits_two(repo: Path, tmp_path: Path) -> None:
    p = tmp_path / "bogus.yaml"
    p.write_text((repo / "configs/default.yaml").read_text() + "\nbogus_key: 1\n")
    res = _cli("config", "check", str(p))
    assert res.returncode == 2
    assert "bogus_key" in res.stderr and str(p) in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_check_negative_size_exits_two(repo: Path, tmp_path: Path) -> None:
    data = yaml.safe_load((repo / "configs/default.yaml").read_text())
    data["disk"]["max_size"] = -4096
    p = tmp_path / "neg.yaml"
    p.write_text(yaml.safe_dump(data))
    res = _cli("config", "check", str(p))
    assert res.returncode == 2
    assert "disk.max_size" in res.stderr and "negative" in res.stderr


def test_cli_check_shows_env_override(repo: Path) -> None:
    import os

    env = dict(os.environ, KVSTORE_DISK__CODEC="zstd")
    res = _cli("config", "check", str(repo / "configs/default.yaml"), env=env)
    assert res.returncode == 0
    assert yaml.safe_load(res.stdout)["disk"]["codec"] == "zstd"


def test_frame_bound_too_small_for_one_block_is_refused(tmp_path: Path) -> None:
    # max_frame_bytes 16 used to be accepted, and then every login failed.
    p = tmp_path / "tiny-frames.yaml"
    p.write_text("daemon:\n  max_frame_bytes: 16\n")
    with pytest.raises(ConfigError) as info:
        load_config(p, environ={})
    least = KVStoreConfig().daemon.min_frame_bytes(KVStoreConfig().model.widest_layout())  # `auto`: float32 at most
    text = str(info.value)
    assert "tiny-frames.yaml" in text and "daemon.max_frame_bytes is 16 bytes" in text and f"is {least}" in text
    ok = tmp_path / "just-enough.yaml"
    ok.write_text(f"daemon:\n  max_frame_bytes: {least}\n")
    assert int(load_config(ok, environ={}).daemon.max_frame_bytes) == least
    # the bound follows the model: a larger block needs a larger frame
    big = parse_config({"model": {"num_layers": 64}, "daemon": {"max_frame_bytes": "64MiB"}})
    with pytest.raises(ConfigError, match=r"daemon.max_frame_bytes is 65536 bytes; the minimum"):
        parse_config({"model": big.model.model_dump(), "daemon": {"max_frame_bytes": 65536}})


def test_connection_caps_must_be_consistent() -> None:
    with pytest.raises(ConfigError, match=r"max_connections_per_peer \(10\) exceeds max_connections \(4\)"):
        parse_config({"daemon": {"max_connections": 4, "max_connections_per_peer": 10}})


def test_env_sets_top_level_fields() -> None:
    cfg = parse_config({"tiers": ["host"]}, "f.yaml", {"KVSTORE_CONNECTOR": "sidecar", "KVSTORE_TIERS": "host, lmdb"})
    assert cfg.connector == "sidecar" and cfg.tiers == ["host", "lmdb"]
    with pytest.raises(ConfigError, match=r"connector: .*\(from environment variable KVSTORE_CONNECTOR\)"):
        parse_config({}, "f.yaml", {"KVSTORE_CONNECTOR": "remote"})


def test_unknown_env_variable_warns_naming_the_closest_field(caplog: pytest.LogCaptureFixture) -> None:
    env = {"KVSTORE_DISK_MAX_SIZE": "1GiB", "KVSTORE_TEST_DEVICE": "cpu"}
    with caplog.at_level("WARNING", logger="kvstore.config.loader"):
        cfg = parse_config({}, "f.yaml", env)
    assert cfg == parse_config({}, "f.yaml", {})
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring environment variable KVSTORE_DISK_MAX_SIZE: it names no config field; "
        "did you mean KVSTORE_DISK__MAX_SIZE?"
    ]


def test_kvstore_config_names_the_file_when_no_path_is_given(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("tiers: [host]\n")
    assert load_config(None, environ={"KVSTORE_CONFIG": str(p)}).tiers == ["host"]
    with pytest.raises(ConfigError, match=r"invalid config .*nope.yaml \(from KVSTORE_CONFIG\):\n  - no such file"):
        load_config(None, environ={"KVSTORE_CONFIG": str(tmp_path / "nope.yaml")})
    other = tmp_path / "other.yaml"
    other.write_text("tiers: [host, lmdb]\n")
    assert load_config(other, environ={"KVSTORE_CONFIG": str(p)}).tiers == ["host", "lmdb"]


def test_cli_reads_kvstore_config(tmp_path: Path) -> None:
    import os

    sock = tmp_path / "absent.sock"
    p = tmp_path / "c.yaml"
    p.write_text(f"daemon:\n  socket_path: {sock}\n")
    res = _cli("stats", env=dict(os.environ, KVSTORE_CONFIG=str(p)))
    assert res.returncode == 1 and res.stderr.startswith("error: ") and str(sock) in res.stderr, res.stderr


@pytest.mark.parametrize(("n", "exact", "human"), [
    (0, "0", "0B"), (1500, "1500", "1500B"), (1000, "1KB", "1KB"), (1024, "1KiB", "1KiB"),
    (4 * 10**9, "4GB", "4GB"), (4 << 30, "4GiB", "4GiB"), (1536 << 20, "1536MiB", "1536MiB"),
    (2 * 10**12, "2TB", "2TB"), (123456789, "123456789", "117.7MiB"),
])
def test_sizes_are_shown_in_the_unit_family_they_were_given_in(n: int, exact: str, human: str) -> None:
    from pydantic import TypeAdapter

    from kvstore.config.units import Size, exact_size, format_size

    assert exact_size(n) == exact and format_size(n) == human
    assert TypeAdapter(Size).validate_python(exact) == n  # the text reads back as the same number


def test_placement_policy_by_name_and_error_names_field_and_file(tmp_path: Path) -> None:
    from kvstore.policy.named import DEFAULT_PLACEMENT, POLICIES

    assert parse_config({}).policy.placement == DEFAULT_PLACEMENT == "adaptive"
    for name in POLICIES:
        assert parse_config({"policy": {"placement": name}}).policy.placement_policy() is POLICIES[name]
    p = tmp_path / "kv.yaml"
    p.write_text("policy:\n  placement: arc\n")
    with pytest.raises(ConfigError, match=r"policy\.placement: Input should be 'lru', 's3fifo', 'gdsf' or 'adaptive'") as info:
        load_config(p, environ={})
    assert str(p) in str(info.value)


@pytest.mark.parametrize("old", [{"disk": {"eviction": "gdsf"}}, {"host": {"eviction": "duel"}},
                                 {"file": {"eviction": "s3fifo"}}, {"slab": {"eviction": "lru"}},
                                 {"policy": {"carry_uses": True}}, {"policy": {"exclusive_tiers": True}},
                                 {"policy": {"use_memory": 4}}, {"policy": {"duel_scope": "below_gpu"}},
                                 {"policy": {"gdsf_weight": "damped"}}])
def test_every_removed_placement_knob_says_policy_placement_replaced_it(old: dict) -> None:
    section, fields = next(iter(old.items()))
    with pytest.raises(ConfigError) as info:
        parse_config(old, "old.yaml")
    message = str(info.value)
    assert f"'{section}.{next(iter(fields))}' was removed: policy.placement" in message and "old.yaml" in message


def test_events_report_interval_is_bounded_and_named_with_its_file() -> None:
    assert parse_config({"events": {"report_interval_s": 0}}, "f.yaml").events.report_interval_s == 0.0
    assert parse_config({}, "f.yaml").events.report_interval_s == 1.0
    with pytest.raises(ConfigError, match=r"(?s)f\.yaml.*events\.report_interval_s: Input should be greater than or equal to 0 \(got -1\)"):
        parse_config({"events": {"report_interval_s": -1}}, "f.yaml")
    with pytest.raises(ConfigError, match=r"events\.report_interval_s: Input should be less than or equal to 3600"):
        parse_config({"events": {"report_interval_s": 7200}}, "f.yaml")
    with pytest.raises(ConfigError, match=r"KVSTORE_EVENTS__REPORT_INTERVAL_S"):
        parse_config({}, "f.yaml", {"KVSTORE_EVENTS__REPORT_INTERVAL_S": "soon"})




@pytest.mark.parametrize(("field", "value", "says"), [
    ("max_layout_slots", 10, "greater than or equal to 1024"),
    ("max_layouts_per_tenant", 0, "greater than or equal to 1"),
    ("layouts", "some", "'model' or 'any'"),
])
def test_the_any_layout_limits_refuse_a_bad_value_naming_field_and_file(field: str, value: object, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"daemon": {field: value}}, "daemon.yaml")
    assert f"daemon.{field}" in str(info.value) and "daemon.yaml" in str(info.value) and says in str(info.value)
