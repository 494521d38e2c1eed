"""Adapter (1) through the sidecar daemon: blocks one vLLM process stored are found by another, and after a restart."""

from __future__ import annotations

from needs_vllm import require_vllm

require_vllm()

# ruff: noqa: E402 - the imports below need vLLM
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import harness as h
from kvstore.daemon.wire.frames import DaemonError
from offload_setup import PROMPT, engine, kvstore_config, prompt_keys, scheduled, tier_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from daemonlib import REPO, cleanup, short_tmpdir, start_daemon, write_config  # noqa: E402


def _layout_section(model: Path, root: Path) -> dict[str, Any]:
    """The ``model:`` section a daemon needs for this vLLM engine's chunks (read from an embedded engine)."""
    probe = engine(model, kvstore_config(root / "probe"))
    layout = tier_of(probe).layout
    probe.scheduler.shutdown()
    return {"model_id": layout.model_id, "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim, "block_size": layout.block_size, "dtype": layout.dtype}


def _sidecar_config(root: Path, socket_path: str) -> Path:
    path = root / "engine.yaml"
    path.write_text(yaml.safe_dump({"connector": "sidecar", "daemon": {"socket_path": socket_path}}))
    return path


def test_blocks_stored_by_one_process_are_found_by_another_and_after_a_daemon_restart() -> None:
    root = short_tmpdir()
    daemon = None
    try:
        model = h.model_dir(root)
        (root / "probe").mkdir()
        section = _layout_section(model, root)
        daemon_config = write_config(root, model=section, host={"capacity": "1MiB"})
        daemon = start_daemon(daemon_config)
        config = _sidecar_config(root, daemon.socket_path)

        writer = engine(model, config)  # this process stores the prompt in the daemon
        writer.scheduler.add_request(h.make_request("a", PROMPT))
        assert scheduled(writer.run("a"), "a") == [50]
        tier = tier_of(writer)
        assert [tier.store.contains(k) for k in prompt_keys(tier.layout)] == [True] * 3
        writer.scheduler.shutdown()

        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("offload_proc.py")), str(model),
                               str(config), "b"], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"scheduled": [2], "loaded": 3, "kv_ok": True}

        daemon.stop()
        daemon = start_daemon(daemon_config)  # same disk: the blocks survive the restart
        reader = engine(model, config)
        reader.scheduler.add_request(h.make_request("c", PROMPT))
        assert scheduled(reader.run("c"), "c") == [2]
        assert reader.loaded_kv_is("c", PROMPT) and len(reader.loaded["c"]) == 3
        reader.scheduler.shutdown()
    finally:
        cleanup(daemon, root)


def test_a_daemon_for_another_layout_is_refused_naming_the_model_section_it_needs() -> None:
    root = short_tmpdir()
    daemon = None
    try:
        model = h.model_dir(root)
        (root / "probe").mkdir()
        section = _layout_section(model, root)
        daemon = start_daemon(write_config(root))  # the daemon tests' own tiny layout
        # The refusal names each differing field, then prints the model section this engine needs.
        needs = r"(?s)serves one model's KV layout.*daemon\.layouts: any.*model\.num_layers.*needs this model section.*model_id: "
        with pytest.raises(DaemonError, match=needs + re.escape(section["model_id"])):
            engine(model, _sidecar_config(root, daemon.socket_path))
    finally:
        cleanup(daemon, root)


def test_a_paused_daemon_makes_the_offloading_tier_miss_at_its_deadline_and_hit_again_after() -> None:
    """SIGSTOP of the daemon: vLLM's scheduler asks the tier, which misses within its lookup deadline (then
    at once behind the open breaker), so the request is computed in full without waiting for the pause; after
    SIGCONT the breaker closes and a new engine loads the prompt's 3 stored chunks."""
    import signal
    import time

    root = short_tmpdir()
    daemon = None
    try:
        model = h.model_dir(root)
        (root / "probe").mkdir()
        daemon = start_daemon(write_config(root, model=_layout_section(model, root), host={"capacity": "1MiB"}))
        config = root / "engine.yaml"
        config.write_text(yaml.safe_dump({"connector": "sidecar", "daemon": {"socket_path": daemon.socket_path},
                                          "deadlines": {"lookup_ms": 50, "save_ms": 300, "load_floor_ms": 300,
                                                        "breaker_open_s": 0.2, "breaker_open_max_s": 0.5}}))
        writer = engine(model, config)
        writer.scheduler.add_request(h.make_request("a", PROMPT))
        assert scheduled(writer.run("a"), "a") == [50]
        writer.scheduler.shutdown()

        reader = engine(model, config)
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            reader.scheduler.add_request(h.make_request("b", PROMPT))
            assert scheduled(reader.run("b"), "b") == [50]  # nothing found: computed in full
            elapsed = time.monotonic() - t0
            time.sleep(max(0.0, 3.0 - elapsed))
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert elapsed < 2.5, f"vLLM's scheduler waited {elapsed:.1f} s on a paused daemon"
        tier = tier_of(reader)
        t1 = time.monotonic()
        while not tier.store.contains(prompt_keys(tier.layout)[0]):  # the breaker's probe finds it again
            assert time.monotonic() - t1 < 10, "the daemon's blocks are not found after SIGCONT"
            time.sleep(0.1)
        reader.scheduler.shutdown()
        again = engine(model, config)  # a new engine (the reader's own GPU cache holds the prompt now)
        again.scheduler.add_request(h.make_request("c", PROMPT))
        assert scheduled(again.run("c"), "c") == [2]
        assert again.loaded_kv_is("c", PROMPT) and len(again.loaded["c"]) == 3
        again.scheduler.shutdown()
    finally:
        if daemon is not None and daemon.proc.poll() is None:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        cleanup(daemon, root)
