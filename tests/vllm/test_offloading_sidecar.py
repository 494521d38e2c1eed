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
from kvstore.daemon.frames import DaemonError
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
        needs = r"(?s)differs from the daemon's.*model\.num_layers.*needs this model section.*model_id: "
        with pytest.raises(DaemonError, match=needs + re.escape(section["model_id"])):
            engine(model, _sidecar_config(root, daemon.socket_path))
    finally:
        cleanup(daemon, root)
