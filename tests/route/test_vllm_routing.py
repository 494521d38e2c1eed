"""Routing to vLLM replicas, in-process against fake ones: prompts matched against the BlockStored events they
publish (vLLM's msgpack bytes, vLLM's hashes), a fleet mixing kvstore and vLLM block sizes, LoRA requests by load,
vLLM's empty /health and Prometheus /metrics, and --replica specs for them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvstore.hashing import block_keys
from kvstore.layout import KVLayout
from kvstore.route.index import RouterIndex
from kvstore.route.kv_events import decode_batch
from kvstore.route.openai_request import CompletionRequest
from kvstore.route.policy import CostPolicy, ReplicaLoad
from kvstore.route.proxy import HIT_HEADER, ROUTED_HEADER, Router
from kvstore.route.replica_metrics import prometheus_totals
from kvstore.route.replica_set import ReplicaSet, ReplicaSpec, parse_replica
from kvstore.route.vllm_keys import VllmKeyScheme

KNOWN = {c["name"]: c for c in json.loads((Path(__file__).parent / "vllm_known_hashes.json").read_text())["cases"]}
LAYOUT = KVLayout(2, 2, 8, 16, "float16", model_id="fake")
VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 7.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 12345.0
"""


def _ids(req: CompletionRequest) -> list[int]:
    assert isinstance(req.prompt, tuple)
    return list(req.prompt)


def _replica(name: str, health: Callable[[], web.Response], metrics: Callable[[], web.Response]) -> web.Application:
    """A fake replica answering ``health()`` on /health, ``metrics()`` on /metrics, and completions."""
    async def get_health(request: web.Request) -> web.Response:
        return health()

    async def get_metrics(request: web.Request) -> web.Response:
        return metrics()

    async def complete(request: web.Request) -> web.Response:
        return web.json_response({"served_by": name})

    app = web.Application()
    app.router.add_get("/health", get_health)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_post("/v1/completions", complete)
    return app


def _vllm_replica(name: str, metrics: bytes = b"", content_type: str = "text/plain") -> web.Application:
    """What a vLLM server answers: an empty 200 /health, Prometheus text /metrics."""
    headers = {"Content-Type": f"{content_type}; version=0.0.4; charset=utf-8"}
    return _replica(name, lambda: web.Response(status=200), lambda: web.Response(body=metrics, headers=headers))


def _kvstore_replica(name: str) -> web.Application:
    """A kvstore engine server: its layout on /health, its gauges on /metrics."""
    return _replica(name, lambda: web.json_response({"status": "ok", "kv_layout": dataclasses.asdict(LAYOUT)}),
                    lambda: web.Response(text="kvstore_engine_in_flight_requests 0\nkvstore_engine_in_flight_tokens 0\n"))


def _run(fleet: dict[str, tuple[web.Application, str]],
         test: Callable[[TestClient, Router], Awaitable[None]]) -> None:
    """Serve ``fleet`` (name -> (app, spec options after the URL)) behind a router and run ``test``."""
    async def main() -> None:
        servers = {n: TestServer(app) for n, (app, _) in fleet.items()}
        for s in servers.values():
            await s.start_server()
        specs = [parse_replica(f"{str(servers[n].make_url('')).rstrip('/')},name={n}{opts}")
                 for n, (_, opts) in fleet.items()]
        router = Router(ReplicaSet(specs, interval=3600), RouterIndex(), CostPolicy(), _ids, threading.Lock())
        client = TestClient(TestServer(router.app()))
        await client.start_server()
        try:
            await test(client, router)
        finally:
            await client.close()
            for s in servers.values():
                await s.close()

    asyncio.run(main())


def _publish(router: Router, replica: str, hashes: list[Any], token_ids: list[int], block_size: int,
             extra_keys: list[Any] | None = None) -> None:
    """Apply a BlockStored batch as vLLM 0.33's publisher encodes it (msgspec tagged map in an array batch)."""
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": token_ids,
             "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": extra_keys, "group_idx": 0, "kv_cache_spec_kind": "full"}
    router.index.apply(replica, decode_batch(msgspec.msgpack.encode([1.0, [event], None])))


async def _completion(client: TestClient, prompt: list[int], **extra: Any) -> tuple[str, str]:
    resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, **extra})
    assert resp.status == 200
    assert (await resp.json())["served_by"] == resp.headers[ROUTED_HEADER]
    return resp.headers[ROUTED_HEADER], resp.headers[HIT_HEADER]


def test_a_prompt_goes_to_the_vllm_replica_whose_events_hold_its_prefix() -> None:
    case = KNOWN["default"]  # vLLM's own hashes of tokens 0..39 (tests/vllm checks them against vLLM)

    async def test(client: TestClient, router: Router) -> None:
        assert all(r.up and r.layout is None for r in router.replicas.replicas.values())
        _publish(router, "v2", case["ints"], case["token_ids"][:32], 16)
        assert await _completion(client, case["token_ids"]) == ("v2", "2")
        answer = await (await client.post("/route", json={"prompt": case["token_ids"]})).json()
        assert (answer["replica"], answer["prompt_tokens"], answer["prompt_blocks"]) == ("v2", 40, 2)
        assert answer["costs"] == {"v1": 2.0, "v2": 0.0}
        # a salted request has other keys: v2's blocks do not count for it
        assert await _completion(client, case["token_ids"], cache_salt="tenant-a") == ("v1", "0")
        salted = KNOWN["cache_salt"]
        _publish(router, "v1", salted["ints"][:1], salted["token_ids"][:16], 16, [("tenant-a",)])
        assert await _completion(client, case["token_ids"], cache_salt="tenant-a") == ("v1", "1")

    _run({"v1": (_vllm_replica("v1"), ",keys=vllm"), "v2": (_vllm_replica("v2"), ",keys=vllm")}, test)


def test_bytes_hashes_and_a_seed_are_matched_as_the_spec_says() -> None:
    case = KNOWN["hash_seed"]  # PYTHONHASHSEED=1234, 4-token blocks

    async def test(client: TestClient, router: Router) -> None:
        _publish(router, "seeded", [bytes.fromhex(d) for d in case["digests"]], case["token_ids"][:8], 4)
        _publish(router, "unseeded", VllmKeyScheme(4, int_hashes=False).block_hashes(case["token_ids"]),
                 case["token_ids"][:8], 4)
        assert await _completion(client, case["token_ids"]) == ("seeded", "2")

    _run({"unseeded": (_vllm_replica("unseeded"), ",keys=vllm,block_size=4,int_hashes=0"),
          "seeded": (_vllm_replica("seeded"), ",keys=vllm,block_size=4,int_hashes=0,hash_seed=1234")}, test)


def test_a_mixed_fleet_picks_the_replica_holding_more_of_the_prompt_in_tokens() -> None:
    prompt = list(range(1000, 1100))  # 100 tokens: 6 kvstore blocks of 16, 3 vLLM blocks of 32
    vllm_keys = VllmKeyScheme(32).keys(prompt)
    kv_keys = block_keys(prompt, LAYOUT)

    async def test(client: TestClient, router: Router) -> None:
        assert router.replicas.layout == LAYOUT
        router.index.store("k", kv_keys[:2], "gpu")  # 32 tokens
        _publish(router, "v", vllm_keys[:2], prompt[:64], 32)  # 64 tokens in 2 blocks
        assert await _completion(client, prompt) == ("v", "2")
        answer = await (await client.post("/route", json={"prompt": prompt})).json()
        assert answer["costs"] == {"k": 4.0, "v": 2.0} and answer["prompt_blocks"] == 3
        router.index.store("k", kv_keys[:5], "gpu")  # 80 tokens beat v's 64 though v has fewer, larger blocks
        assert await _completion(client, prompt) == ("k", "5")
        answer = await (await client.post("/route", json={"prompt": prompt})).json()
        assert answer["costs"] == {"k": 1.0, "v": 2.0} and answer["prompt_blocks"] == 6
        router.index.store("k", kv_keys[:4], "host")  # 4 of k's 5 now also in host: gpu is still the fastest
        assert (await (await client.post("/route", json={"prompt": prompt})).json())["costs"]["k"] == 1.0
        metrics = await (await client.get("/stats")).json()
        assert metrics["decisions"] == 5 and metrics["hit_blocks"] == 2 + 2 + 5 + 5 + 5

    _run({"k": (_kvstore_replica("k"), ""), "v": (_vllm_replica("v"), ",keys=vllm,block_size=32")}, test)


def test_a_lora_request_is_routed_to_vllm_replicas_by_load_only() -> None:
    case = KNOWN["default"]

    async def test(client: TestClient, router: Router) -> None:
        _publish(router, "v2", case["ints"], case["token_ids"][:32], 16)
        assert await _completion(client, case["token_ids"], model="base") == ("v2", "2")
        assert await _completion(client, case["token_ids"], model="my-lora") == ("v1", "0")

    _run({"v1": (_vllm_replica("v1"), ",keys=vllm,model=base"), "v2": (_vllm_replica("v2"), ",keys=vllm,model=base")},
         test)


def test_vllm_prometheus_metrics_are_its_load() -> None:
    assert prometheus_totals(VLLM_METRICS) == {"vllm:num_requests_running": 3.0, "vllm:num_requests_waiting": 1.0,
                                               "vllm:num_requests_waiting_by_reason": 7.0,
                                               "vllm:prompt_tokens_total": 12345.0}

    async def test(client: TestClient, router: Router) -> None:
        busy = router.replicas.replicas["busy"]
        assert busy.up and busy.reported == ReplicaLoad(4, 0)  # 2 + 1 running, 1 waiting; by-reason not counted
        assert router.replicas.replicas["idle"].reported == ReplicaLoad(0, 0)
        assert await _completion(client, list(range(40))) == ("idle", "0")

    _run({"busy": (_vllm_replica("busy", VLLM_METRICS.encode()), ",keys=vllm"),
          "idle": (_vllm_replica("idle"), ",keys=vllm")}, test)


@pytest.mark.parametrize(("body", "content_type"), [
    (b"\xff\xfe\x00garbage{{{", "text/plain"),
    (b"vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\nvllm:num_requests_running{x=\"1\"} oops\n",
     "text/plain"),
    (b"vllm:num_requests_running -5\nvllm:num_requests_waiting\n{} 3\n", "text/plain"),
    (b'{"in_flight_requests": "many", "in_flight_tokens": [1]}', "application/json"),
    (b"kvstore_engine_in_flight_requests NaN\nkvstore_engine_in_flight_tokens -3\n", "text/plain"),
    (b"[1, 2", "application/json"),
    (b'["not", "an", "object"]', "application/json"),
])
def test_garbage_metrics_never_take_a_replica_down_or_crash_the_poller(body: bytes, content_type: str) -> None:
    async def test(client: TestClient, router: Router) -> None:
        await router.replicas.poll(router._session)  # type: ignore[arg-type]
        odd = router.replicas.replicas["odd"]
        assert odd.up and odd.reason is None and odd.reported == ReplicaLoad(0, 0)

    _run({"odd": (_vllm_replica("odd", body, content_type), ",keys=vllm")}, test)


@pytest.mark.parametrize(("text", "spec"), [
    ("http://h:1,keys=vllm", ReplicaSpec("h:1", "http://h:1", vllm=VllmKeyScheme())),
    ("http://h:1,keys=vllm,block_size=32,hash_seed=0,hash=sha256,int_hashes=0,model=m,events=tcp://h:2,name=v",
     ReplicaSpec("v", "http://h:1", "tcp://h:2", None, VllmKeyScheme(32, "0", "sha256", False), "m")),
    ("http://h:1,keys=kvstore", ReplicaSpec("h:1", "http://h:1")),
])
def test_vllm_replica_specs(text: str, spec: ReplicaSpec) -> None:
    assert parse_replica(text) == spec


@pytest.mark.parametrize(("text", "bad"), [
    ("http://h:1,keys=sglang", "'keys=sglang' is not keys=kvstore or keys=vllm"),
    ("http://h:1,block_size=32", "'block_size=32' needs keys=vllm"),
    ("http://h:1,keys=vllm,block_size=0", "'block_size=0' is not a positive number of tokens"),
    ("http://h:1,keys=vllm,block_size=big", "'block_size=big' is not a positive number of tokens"),
    ("http://h:1,keys=vllm,int_hashes=yes", "'int_hashes=yes' is not int_hashes=0 or int_hashes=1"),
    ("http://h:1,keys=vllm,hash=md5", "'hash=md5' is not one of vLLM's sha256, sha256_cbor, xxhash, xxhash_cbor"),
    ("http://h:1,keys=vllm,hash=xxhash", "hash=xxhash without hash_seed: vLLM seeds non-cryptographic hashes"),
    ("http://h:1,keys=vllm,keys=vllm", "'keys=vllm' is not events=ENDPOINT"),
    ("http://h:1,keys=vllm,seed=1", "'seed=1' is not events=ENDPOINT, replay=ENDPOINT, name=NAME, keys=kvstore|vllm"),
])
def test_bad_vllm_specs_name_the_part(text: str, bad: str) -> None:
    with pytest.raises(ValueError, match="--replica") as exc:
        parse_replica(text)
    assert bad in str(exc.value)


def test_a_replica_without_keys_vllm_answering_like_vllm_is_up_by_load_and_a_bad_health_body_is_down() -> None:
    def bad_health() -> web.Response:
        return web.Response(body=b"<html>ok</html>", content_type="text/html")

    async def test(client: TestClient, router: Router) -> None:
        plain = router.replicas.replicas["plain"]
        assert plain.up and plain.layout is None and plain.reported == ReplicaLoad(4, 0)  # Prometheus: not JSON
        odd = router.replicas.replicas["odd"]
        assert not odd.up and odd.reason is not None and odd.reason.endswith("/health: not JSON (Expecting value: "
                                                                              "line 1 column 1 (char 0))")
        assert router.replicas.layout is None
        assert await _completion(client, list(range(40))) == ("plain", "0")

    _run({"plain": (_vllm_replica("plain", VLLM_METRICS.encode()), ""),
          "odd": (_replica("odd", bad_health, lambda: web.json_response({})), "")}, test)
