"""Two engine processes share one daemon: the second finds the first's prompt prefix and decodes the same."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from daemonlib import REPO, cleanup, short_tmpdir, start_daemon, write_config
from kvstore.daemon.wire.layout_check import layout_fields

CONNECTOR_TESTS = REPO / "tests" / "connector"
# The built-in engine's tiny random model, as connlib.engine_config() builds it: the daemon must serve this layout.
ENGINE_MODEL = {"model_id": "builtin-random-seed0", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
                "block_size": 4, "dtype": "float32"}

ENGINE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from connlib import GREEDY, engine_config, prompt
    from connectors import build_connector
    from engine import LLM, SamplingParams
    from engine.config import ModelArch
    from kvstore.config import load_config

    conn = build_connector(load_config({config!r}))
    llm = LLM(config=engine_config(), connector=conn, arch={arch})
    out = llm.generate([prompt(1, 45)], SamplingParams(max_tokens={max_tokens}, temperature=0.0))[0]
    lower = [t for t in ("disk", "daemon") if t in conn.stats()]
    read = dict(conn.store.h.counters.loaded_blocks)  # blocks this engine read from the daemon
    conn.close()  # flushes the daemon tier
    print(json.dumps({{"connector": type(conn).__name__, "tokens": out.token_ids,
                      "cached": out.metrics.cached_tokens_by_tier, "lower": lower, "read": read}}))
""")
WINDOW_6 = 'ModelArch(**{**ModelArch.tiny().__dict__, "sliding_window": 6})'
"""Mistral-style: every layer of the tiny model attends through a 6-token window."""


def run_engine(config: Path, max_tokens: int = 6, arch: str = "None") -> dict:
    script = ENGINE.format(tests=str(CONNECTOR_TESTS), config=str(config), max_tokens=max_tokens, arch=arch)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_second_engine_reuses_first_engines_prefix() -> None:
    sys.path.insert(0, str(CONNECTOR_TESTS))
    from connlib import GREEDY, engine_config, prompt

    from engine import LLM

    reference = LLM(config=engine_config()).generate([prompt(1, 45)], GREEDY)[0].token_ids
    root = short_tmpdir()
    daemon = None
    try:
        daemon_cfg = write_config(root, model=ENGINE_MODEL, host={"capacity": 64 * 2048})
        daemon = start_daemon(daemon_cfg)
        engine_cfg = root / "engine.yaml"
        engine_cfg.write_text(yaml.safe_dump({"connector": "sidecar", "daemon": {"socket_path": daemon.socket_path}}))

        first = run_engine(engine_cfg)
        second = run_engine(engine_cfg)
        assert first["connector"] == "SidecarConnector"
        assert sum(first["cached"].values()) == 0
        # 11 full blocks served by the daemon's host tier: labelled "daemon:host", not "disk", in the engine's
        # metrics, and the daemon's section of its stats is "daemon"
        assert second["cached"] == {"gpu": 0, "host": 0, "daemon:host": 44, "daemon:disk": 0}
        assert first["lower"] == second["lower"] == ["daemon"]
        assert first["tokens"] == reference and second["tokens"] == reference
        assert daemon.stop() == 0
    finally:
        cleanup(daemon, root)


def test_prefill_on_one_engine_and_decode_on_another_through_the_daemon() -> None:
    """Disaggregated prefill with the built-in engine: a prefill engine computes the prompt and one token, the
    daemon keeps its blocks, a decode engine loads every full one and computes only the partial tail."""
    sys.path.insert(0, str(CONNECTOR_TESTS))
    from connlib import engine_config, prompt

    from engine import LLM, SamplingParams

    reference = LLM(config=engine_config()).generate([prompt(1, 45)], SamplingParams(max_tokens=12, temperature=0.0))
    root = short_tmpdir()
    daemon = None
    try:
        daemon = start_daemon(write_config(root, model=ENGINE_MODEL, host={"capacity": 64 * 2048}))
        engine_cfg = root / "engine.yaml"
        engine_cfg.write_text(yaml.safe_dump({"connector": "sidecar", "daemon": {"socket_path": daemon.socket_path}}))
        prefill = run_engine(engine_cfg, max_tokens=1)
        decode = run_engine(engine_cfg, max_tokens=12)
        assert sum(prefill["cached"].values()) == 0
        # 11 full blocks: only the 45th token computed
        assert decode["cached"] == {"gpu": 0, "host": 0, "daemon:host": 44, "daemon:disk": 0}
        assert decode["tokens"] == reference[0].token_ids and prefill["tokens"] == reference[0].token_ids[:1]
    finally:
        cleanup(daemon, root)


def test_a_windowed_model_reads_only_the_window_from_the_daemon_and_decodes_as_recompute() -> None:
    """Every layer windowed (6 tokens): the second engine's first query (token 44) reads keys 39-44, so of the
    11 blocks the daemon holds it reads blocks 9 and 10 only, and decodes as the model without a cache."""
    sys.path.insert(0, str(CONNECTOR_TESTS))
    from connlib import GREEDY, engine_config, prompt

    from engine import LLM
    from engine.config import ModelArch

    arch = ModelArch(**{**ModelArch.tiny().__dict__, "sliding_window": 6})
    oracle = LLM(config=engine_config(), arch=arch)
    reference = oracle.generate([prompt(1, 45)], GREEDY)[0].token_ids
    model = layout_fields(oracle.pool.layout)
    root = short_tmpdir()
    daemon = None
    try:
        daemon = start_daemon(write_config(root, model=model, host={"capacity": 64 * 2048}))
        engine_cfg = root / "engine.yaml"
        engine_cfg.write_text(yaml.safe_dump({"connector": "sidecar", "daemon": {"socket_path": daemon.socket_path}}))
        first = run_engine(engine_cfg, arch=WINDOW_6)
        second = run_engine(engine_cfg, arch=WINDOW_6)
        assert sum(first["read"].values()) == 0
        assert second["cached"] == {"gpu": 0, "host": 0, "daemon:host": 44, "daemon:disk": 0}
        assert second["read"]["disk"] == 2 and sum(second["read"].values()) == 2  # the daemon: the lower tier
        assert first["tokens"] == reference and second["tokens"] == reference
        assert daemon.stop() == 0
    finally:
        cleanup(daemon, root)
