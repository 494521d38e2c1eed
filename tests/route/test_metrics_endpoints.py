"""Every ``/metrics`` kvstore serves is Prometheus text (parsed by ``prometheus_client``), and its figures agree.

The daemon, ``kvstore engine serve`` and ``kvstore route`` each answer ``/metrics`` in the exposition
format one scrape config reads, with ``/stats`` (the engine and the router) giving the same snapshot as
JSON. The daemon counts the bytes its host tier served for every hit it counts there, however they left
(shared memory or an inline copy), so a hit rate and a read rate taken from one scrape agree.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

prometheus_parser = pytest.importorskip("prometheus_client.parser")

from connectors.embedded import EmbeddedConnector  # noqa: E402
from engine import LLM, EngineConfig  # noqa: E402
from engine.model_text import ModelText  # noqa: E402
from engine.server.app import EngineServer  # noqa: E402
from engine.server.prompt import PromptRenderer  # noqa: E402
from engine.server.worker import EngineWorker  # noqa: E402
from kvstore.config.schema import KVStoreConfig  # noqa: E402
from kvstore.util.prometheus import CONTENT_TYPE  # noqa: E402
from kvstore.route.index import RouterIndex  # noqa: E402
from kvstore.route.policy import CostPolicy  # noqa: E402
from kvstore.route.proxy import Router  # noqa: E402
from kvstore.route.replica_set import ReplicaSet, ReplicaSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from daemonlib import block_for, cleanup, keys_for, short_tmpdir, start_daemon, write_config  # noqa: E402


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``text`` by (name, sorted labels), through prometheus_client's parser (which raises
    on anything that is not the exposition format)."""
    out = {}
    for fam in prometheus_parser.text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_daemons_metrics_parse_and_host_bytes_read_follow_its_hits() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root))
        tier = d.tier()
        keys = keys_for(6, seed=3)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 6
        import torch

        dests = [torch.empty_like(block_for(k)) for k in keys]
        assert tier.get(keys[:4], dests[:4]) == [True] * 4
        assert tier.get(keys[2:], dests[2:]) == [True] * 4
        bpb = tier.layout.bytes_per_block
        tier.close()
        assert d.metrics_url is not None
        with urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10) as resp:
            assert resp.headers["Content-Type"] == CONTENT_TYPE
            got = samples(resp.read().decode())
        host = (("tier", "host"),)
        assert got[("kvstore_hits_total", host)] == 8
        assert got[("kvstore_tier_bytes_read_total", host)] == 8 * bpb  # as many bytes as hits, never 0
        assert got[("kvstore_blocks", host)] == 6
    finally:
        cleanup(d, root)


def _engine_server() -> tuple[EngineServer, EmbeddedConnector]:
    connector = EmbeddedConnector(KVStoreConfig.model_validate({"tiers": ["host"], "host": {"capacity": "1MiB"}}))
    llm = LLM(None, config=EngineConfig(block_size=4, num_gpu_blocks=64, device="cpu"), connector=connector)
    server = EngineServer(EngineWorker(llm), PromptRenderer(ModelText(llm.tokenizer, llm.chat_template)),
                          "builtin", "r0", llm.pool.layout)
    return server, connector


def test_engine_serve_and_route_metrics_parse_and_match_their_stats() -> None:
    async def main() -> dict[str, Any]:
        server, connector = _engine_server()
        server.worker.start()
        engine = TestServer(server.app())
        await engine.start_server()
        spec = ReplicaSpec("r0", str(engine.make_url("")).rstrip("/"))
        router = Router(ReplicaSet([spec], interval=3600), RouterIndex(), CostPolicy(),
                        lambda req: list(str(req.prompt).encode()), threading.Lock())
        client = TestClient(TestServer(router.app()))
        await client.start_server()
        try:
            for _ in range(2):
                resp = await client.post("/v1/completions", json={"prompt": "abcd" * 6, "max_tokens": 3})
                assert resp.status == 200, await resp.text()
            out: dict[str, Any] = {}
            async with TestClient(engine) as eng:
                r = await eng.get("/metrics")
                out["engine_type"], out["engine"] = r.headers["Content-Type"], await r.text()
                out["engine_stats"] = await (await eng.get("/stats")).json()
            r = await client.get("/metrics")
            out["route_type"], out["route"] = r.headers["Content-Type"], await r.text()
            out["route_stats"] = await (await client.get("/stats")).json()
            return out
        finally:
            await client.close()
            await engine.close()
            server.worker.close()
            connector.close()

    out = asyncio.run(main())
    assert out["engine_type"] == out["route_type"] == CONTENT_TYPE
    eng, stats = samples(out["engine"]), out["engine_stats"]
    r0 = (("replica", "r0"),)
    assert eng[("kvstore_engine_requests_total", r0)] == stats["totals"]["requests"] == 2
    assert eng[("kvstore_engine_prompt_tokens_total", r0)] == stats["totals"]["prompt_tokens"]
    assert 0 < eng[("kvstore_engine_cached_tokens_total", r0)] == stats["totals"]["cached_tokens"]  # the 2nd: a hit
    assert eng[("kvstore_engine_gpu_blocks", (("replica", "r0"), ("state", "total")))] == 64
    route, rstats = samples(out["route"]), out["route_stats"]
    assert route[("kvstore_route_decisions_total", ())] == rstats["decisions"] == 2
    assert route[("kvstore_route_hit_blocks_total", ())] == rstats["hit_blocks"]
    assert route[("kvstore_route_replica_decisions_total", r0)] == rstats["replicas"]["r0"]["decisions"] == 2
    assert route[("kvstore_route_replica_up", (("replica", "r0"), ("url", rstats["replicas"]["r0"]["url"])))] == 1
