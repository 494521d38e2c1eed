"""An engine whose KV layout differs from the daemon's is refused with every differing field named, both values,
and the daemon's config file and fields to set; the command line prints that as one line and exits 2."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from daemonlib import LAYOUT, Daemon, cleanup, short_tmpdir, start_daemon, write_config
from engine import EngineConfig
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.wire.frames import DaemonError, ErrorCode
from kvstore.daemon.wire.layout_check import LayoutMismatch, bad_layout_message, decode_bad_layout
from kvstore.layout import KVLayout

# Differs from the daemon's (daemonlib.MODEL: 2 layers, 2 KV heads, head size 8, block 4, float16) in every field.
ENGINE = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32", model_id="engine-model")


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = start_daemon(write_config(root))
    try:
        yield d
    finally:
        cleanup(d, root)


def test_every_differing_field_is_named_with_both_values_and_where_to_set_it(daemon: Daemon) -> None:
    with pytest.raises(LayoutMismatch) as info:
        DaemonClient(ENGINE, socket_path=daemon.socket_path).connect()
    exc = info.value
    assert isinstance(exc, DaemonError) and exc.code == ErrorCode.BAD_LAYOUT  # callers catching DaemonError still do
    assert exc.differences == [("num_layers", 30, 2), ("num_kv_heads", 3, 2), ("head_dim", 64, 8),
                               ("block_size", 16, 4), ("dtype", "float32", "float16"),
                               ("model_id", "engine-model", "daemon-test")]
    assert exc.daemon == LAYOUT and exc.config_source == str(daemon.config)
    text = str(exc)
    assert text == (
        f"the daemon at unix:{daemon.socket_path} serves one model's KV layout (daemon.layouts: model in "
        f"{daemon.config}) and this engine's is another: run it with daemon.layouts: any (make run's "
        "configs/default.yaml, configs/sidecar.yaml) to serve every engine on the host. The differences: "
        "layers: engine 30, daemon 2 (model.num_layers); KV heads: engine 3, daemon 2 (model.num_kv_heads); "
        "head size: engine 64, daemon 8 (model.head_dim); block size: engine 16, daemon 4 (model.block_size); "
        "dtype: engine 'float32', daemon 'float16' (model.dtype); "
        "model id: engine 'engine-model', daemon 'daemon-test' (model.model_id); to keep one layout, set "
        "model.num_layers, model.num_kv_heads, model.head_dim, model.block_size, model.dtype, model.model_id in "
        f"{daemon.config} to the engine's values and restart the daemon")


def test_only_the_differing_fields_are_named(daemon: Daemon) -> None:
    with pytest.raises(LayoutMismatch) as info:
        DaemonClient(dataclasses.replace(LAYOUT, block_size=8), socket_path=daemon.socket_path).connect()
    assert info.value.differences == [("block_size", 8, 4)]
    text = str(info.value)
    assert "block size: engine 8, daemon 4 (model.block_size)" in text and f"set model.block_size in {daemon.config}" in text
    assert "layers" not in text and "model.model_id" not in text and "model.dtype" not in text


def test_the_daemons_layout_survives_the_wire_format() -> None:
    message = bad_layout_message(ENGINE.fingerprint, LAYOUT, "/etc/kvstore/daemon.yaml")
    assert decode_bad_layout(message) == (LAYOUT, "/etc/kvstore/daemon.yaml")
    assert message.startswith(f"HELLO: layout fingerprint {ENGINE.fingerprint.hex()} differs from the daemon's "
                              f"{LAYOUT.fingerprint.hex()}; ")  # still readable as it is
    # An older daemon's text, or one cut at the 1 KiB error limit: no layout to compare, the plain error stays.
    assert decode_bad_layout("HELLO: layout fingerprint ab differs from the daemon's cd (model 'x')") is None
    assert decode_bad_layout(message[: message.index('"num_layers"')]) is None
    assert decode_bad_layout(message.replace('"num_layers": 2', '"num_layers": -1')) is None


def test_command_line_prints_the_mismatch_as_one_line_and_exits_2(daemon: Daemon, tmp_path: Path) -> None:
    engine_yaml = tmp_path / "engine.yaml"  # the engine's side: the daemon, and the defaults for everything else
    engine_yaml.write_text(yaml.safe_dump({"connector": "sidecar", "daemon": {"socket_path": daemon.socket_path}}))
    commands = (
        ["demo", "--model", "builtin", "--config", str(engine_yaml), "--users", "1", "--turns", "1", "--no-progress"],
        ["generate", "--model", "builtin", "--config", str(engine_yaml), "hello"],
    )
    for argv in commands:
        res = subprocess.run([sys.executable, "-m", "kvstore", *argv], capture_output=True, text=True, cwd=tmp_path,
                             timeout=300)
        assert res.returncode == 2, (argv, res.stdout, res.stderr)
        err = res.stderr.strip()
        assert "\n" not in err and "Traceback" not in err, err
        assert err.startswith(f"error: the daemon at unix:{daemon.socket_path} serves one model's KV layout "
                              f"(daemon.layouts: model in {daemon.config}) and this engine's is another: run it with "
                              "daemon.layouts: any")
        # The built-in tiny model: head size 16 in blocks of 16 tokens, the engine's default dtype, its own id.
        for field in ("head size: engine 16, daemon 8 (model.head_dim)", "block size: engine 16, daemon 4",
                      f"dtype: engine {EngineConfig().kv_dtype_name()!r}, daemon 'float16'",
                      "model id: engine 'builtin-random-seed0'",
                      f"in {daemon.config} to the engine's values"):
            assert field in err, (argv, err)
        assert "layers:" not in err and "KV heads:" not in err  # 2 and 2 on both sides
