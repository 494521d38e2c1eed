"""kvstore's full KV connector: vLLM's real Scheduler on the scheduler side, the real worker side on CPU tensors."""

from __future__ import annotations

from needs_vllm import require_vllm

require_vllm()

# ruff: noqa: E402 - the imports below need vLLM
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import harness as h
from connectors.engine_store import daemon_model_section
from connectors.vllm.connector import block_layout
from full_rig import FullRig, full_connector, sidecar_config
from offload_setup import PROMPT

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from daemonlib import Daemon, cleanup, short_tmpdir, start_daemon, write_config  # noqa: E402

import yaml  # noqa: E402


class Site:
    """A daemon for this model's block layout, and what an engine needs to reach it."""

    def __init__(self) -> None:
        self.root = short_tmpdir()
        self.model = h.model_dir(self.root)
        cfg = h.vllm_config(self.model, full_connector(self.root / "not-read.yaml"))
        layout = block_layout(cfg, h.make_kv_cache_config(cfg)).layout
        section = yaml.safe_load(daemon_model_section(layout))["model"]
        self.daemon_config = write_config(self.root, model=section, host={"capacity": "1MiB"})
        self.daemon: Daemon | None = start_daemon(self.daemon_config)
        self.config = sidecar_config(self.root, self.daemon.socket_path)

    def restart(self) -> None:
        assert self.daemon is not None
        self.daemon.stop(signal.SIGTERM)
        self.daemon = start_daemon(self.daemon_config)


@pytest.fixture
def site() -> Iterator[Site]:
    s = Site()
    try:
        yield s
    finally:
        cleanup(s.daemon, s.root)


def scheduled(outs: list[Any], req_id: str) -> list[int]:
    return [o.num_scheduled_tokens[req_id] for o in outs if req_id in o.num_scheduled_tokens]


def test_prompt_saved_by_one_request_is_loaded_layer_by_layer_for_the_next(site: Site) -> None:
    rig = FullRig(site.model, site.config)
    try:
        rig.scheduler.add_request(h.make_request("a", PROMPT))
        assert scheduled(rig.run("a"), "a") == [50]
        assert rig.scheduler.reset_prefix_cache()  # vLLM's own cache forgets the prompt

        rig.scheduler.add_request(h.make_request("b", PROMPT, max_tokens=2))
        out = rig.first_step("b")
        assert out.num_scheduled_tokens == {"b": 2}  # 48 tokens from kvstore, only the suffix computed
        loads = out.kv_connector_metadata.loads
        assert [len(t.keys) for t in loads] == [3]
        assert rig.blocks_hold("b", PROMPT, 3)
        assert rig.load_errors[-1] == set()
        rig.run("b")
    finally:
        rig.close()


def test_corrupt_block_is_a_load_error_and_recomputed(site: Site) -> None:
    rig = FullRig(site.model, site.config)
    try:
        rig.scheduler.add_request(h.make_request("a", PROMPT))
        rig.run("a")
        layout = rig.worker.connector_worker.layout  # type: ignore[union-attr]
        rig.close()
        assert site.daemon is not None
        site.daemon.stop(signal.SIGTERM)
        _flip_byte_on_disk(site.root / "lmdb", layout, 1)  # the middle block, while the daemon is down
        site.daemon = start_daemon(site.daemon_config)

        rig = FullRig(site.model, site.config)
        rig.scheduler.add_request(h.make_request("b", PROMPT))
        first = rig.first_step("b")
        assert first.num_scheduled_tokens == {"b": 2}  # kvstore still lists the block: 48 tokens claimed
        failed = rig.load_errors[-1]
        bad_block = first.kv_connector_metadata.loads[0].block_ids[0][1]
        assert failed == {bad_block}
        outs = rig.run("b")
        assert scheduled(outs, "b")[0] == 34  # recomputed from the corrupt block on
    finally:
        rig.close()


def _flip_byte_on_disk(path: Path, layout: Any, block: int) -> None:
    from connectors.engine_keys import PromptKeys
    from kvstore.tiers.lmdb.tier import DiskTier

    key = PromptKeys(layout, None).keys(PROMPT, 3)[block]
    disk = DiskTier(layout, str(path), 16 << 20)  # the size write_config gives the daemon
    with disk.env.begin(write=True) as txn:
        value = bytearray(txn.get(key, db=disk._blocks))
        value[len(value) // 2] ^= 0x01
        txn.put(key, bytes(value), db=disk._blocks)
    disk.close()


def test_tenants_never_see_each_others_blocks(site: Site) -> None:
    rig = FullRig(site.model, site.config)
    try:
        rig.scheduler.add_request(h.make_request("a", PROMPT, cache_salt="tenant-1"))
        rig.run("a")
        assert rig.scheduler.reset_prefix_cache()
        rig.scheduler.add_request(h.make_request("b", PROMPT, cache_salt="tenant-2"))
        assert scheduled(rig.run("b"), "b") == [50]
        assert rig.scheduler.reset_prefix_cache()
        rig.scheduler.add_request(h.make_request("c", PROMPT, cache_salt="tenant-1"))
        assert scheduled(rig.run("c"), "c") == [2]
    finally:
        rig.close()
