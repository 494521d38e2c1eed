"""``kvstore route``'s proxy in-process, against fake replicas: choice, retry, streaming, errors, load, specs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvstore.hashing import block_keys
from kvstore.layout import KVLayout
from kvstore.route.index import RouterIndex
from kvstore.route.openai_request import CompletionRequest
from kvstore.route.policy import CostPolicy, ReplicaLoad
from kvstore.route.proxy import HIT_HEADER, ROUTED_HEADER, Router
from kvstore.route.replica_set import Replica, ReplicaSet, ReplicaSpec, StoreSpec, parse_replica, parse_store

LAYOUT = KVLayout(2, 2, 8, 4, "float16", model_id="fake")
PROMPT = "0123456789abcdefghijklmnopqrstuv"  # 32 bytes: 8 blocks of 4


def _ids(req: CompletionRequest) -> list[int]:
    text = req.prompt if isinstance(req.prompt, str) else "".join(m.content for m in req.messages or ())
    return list(text.encode())


def _fake_replica(name: str, metrics: dict[str, int] | None = None) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "kv_layout": dataclasses.asdict(LAYOUT)})

    async def get_metrics(request: web.Request) -> web.Response:
        load = metrics or {"in_flight_requests": 0, "in_flight_tokens": 0}
        return web.Response(text="".join(f"kvstore_engine_{k} {v}\n" for k, v in load.items()))

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"served_by": name}, headers={"x-kvstore-replica": name})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in ("a", "b"):
            await resp.write(f"data: {json.dumps({'text': part, 'by': name})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    return app


def _run(test: Callable[[TestClient, Router, dict[str, TestServer]], Awaitable[None]],
         metrics: dict[str, dict[str, int]] | None = None) -> None:
    async def main() -> None:
        servers = {n: TestServer(_fake_replica(n, (metrics or {}).get(n))) for n in ("a", "b")}
        for s in servers.values():
            await s.start_server()
        specs = [ReplicaSpec(n, str(s.make_url("")).rstrip("/")) for n, s in servers.items()]
        router = Router(ReplicaSet(specs, interval=3600), RouterIndex(), CostPolicy(), _ids, threading.Lock())
        client = TestClient(TestServer(router.app()))
        await client.start_server()
        try:
            await test(client, router, servers)
        finally:
            await client.close()
            for s in servers.values():
                await s.close()

    asyncio.run(main())


def _hold(router: Router, replica: str, text: str) -> None:
    router.index.add_replica(replica)
    router.index.store(replica, block_keys(list(text.encode()), LAYOUT), "gpu")


def test_the_replica_holding_the_prefix_gets_the_request() -> None:
    async def test(client: TestClient, router: Router, servers: dict[str, TestServer]) -> None:
        _hold(router, "b", PROMPT[:16])  # 4 of the 8 blocks
        resp = await client.post("/v1/completions", json={"prompt": PROMPT})
        assert resp.status == 200 and await resp.json() == {"served_by": "b"}
        assert resp.headers[ROUTED_HEADER] == "b" and resp.headers[HIT_HEADER] == "4"
        assert resp.headers["x-kvstore-replica"] == "b"
        answer = await (await client.post("/route", json={"messages": [{"role": "user", "content": PROMPT}]})).json()
        assert answer["replica"] == "b" and answer["hit_blocks"] == 4 and answer["prompt_blocks"] == 8
        assert answer["costs"] == {"a": 8.0, "b": 4.0}
        metrics = await (await client.get("/stats")).json()
        assert metrics["decisions"] == 2 and metrics["hit_blocks"] == 8 and metrics["prompt_blocks"] == 16
        assert metrics["hit_blocks_histogram"] == {"4-15": 2}
        assert metrics["replicas"]["b"]["decisions"] == 2 and metrics["replicas"]["b"]["in_flight_requests"] == 0

    _run(test)


def test_a_refused_connection_marks_the_replica_down_and_retries_elsewhere() -> None:
    async def test(client: TestClient, router: Router, servers: dict[str, TestServer]) -> None:
        _hold(router, "b", PROMPT)
        assert router.replicas.replicas["b"].up  # the first poll found it
        await servers["b"].close()  # gone before the next poll notices
        resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}]})
        assert resp.status == 200 and (await resp.json()) == {"served_by": "a"}
        assert resp.headers[ROUTED_HEADER] == "a"
        b = router.replicas.replicas["b"]
        assert not b.up and "ClientConnectorError" in (b.reason or "")
        assert router.stats.retries == 1 and b.requests == 0 and b.tokens == 0
        resp = await client.post("/v1/completions", json={"prompt": PROMPT})
        assert resp.headers[ROUTED_HEADER] == "a" and router.stats.retries == 1  # no longer tried

    _run(test)


def test_no_replica_up_is_a_503_naming_each_reason() -> None:
    async def test(client: TestClient, router: Router, servers: dict[str, TestServer]) -> None:
        for s in servers.values():
            await s.close()
        await router.replicas.poll(router._session)  # type: ignore[arg-type]
        resp = await client.post("/v1/completions", json={"prompt": PROMPT})
        assert resp.status == 503
        message = (await resp.json())["error"]["message"]
        assert message.startswith("no replica can take the request (a: http://") and "; b: http://" in message
        assert (await client.get("/health")).status == 503

    _run(test)


def test_a_stream_is_passed_through_as_it_comes() -> None:
    async def test(client: TestClient, router: Router, servers: dict[str, TestServer]) -> None:
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "stream": True})
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        text = (await resp.read()).decode()
        assert text == ('data: {"text": "a", "by": "a"}\n\ndata: {"text": "b", "by": "a"}\n\ndata: [DONE]\n\n')

    _run(test)


@pytest.mark.parametrize(("body", "param"), [({"prompt": PROMPT, "n": 3}, "n"), ({}, "prompt"),
                                            ({"prompt": PROMPT, "stream": "yes"}, "stream")])
def test_a_bad_request_is_refused_by_the_router_naming_the_field(body: dict[str, Any], param: str) -> None:
    async def test(client: TestClient, router: Router, servers: dict[str, TestServer]) -> None:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 400 and (await resp.json())["error"]["param"] == param
        assert router.stats.decisions == 0

    _run(test)


def test_load_counts_own_requests_plus_other_clients_share_of_the_report() -> None:
    async def test(client: TestClient, router: Router, servers: dict[str, TestServer]) -> None:
        a = router.replicas.replicas["a"]
        # The replica reported 3 requests / 300 tokens while the router had none of its own in flight.
        assert a.others == ReplicaLoad(3, 300) and a.reported == ReplicaLoad(3, 300)
        router.replicas.begin("a", 100)
        assert a.load() == ReplicaLoad(4, 400, True)
        router.replicas.end("a", 100)
        assert a.load() == ReplicaLoad(3, 300, True)
        # Busy a loses to idle b for a prompt neither holds.
        resp = await client.post("/v1/completions", json={"prompt": PROMPT})
        assert resp.headers[ROUTED_HEADER] == "b"

    _run(test, metrics={"a": {"in_flight_requests": 3, "in_flight_tokens": 300}})


def test_a_report_never_counts_the_routers_own_requests_twice() -> None:
    r = Replica(ReplicaSpec("a", "http://x"), up=True, requests=2, tokens=200)
    r.others = ReplicaLoad(0, 0)
    assert r.load() == ReplicaLoad(2, 200, True)


def test_a_replica_with_another_layout_is_kept_down() -> None:
    replicas = ReplicaSet([ReplicaSpec("a", "http://a"), ReplicaSpec("b", "http://b")], interval=1)
    assert replicas._check_layout(replicas.replicas["a"], dataclasses.asdict(LAYOUT)) is None
    other = dataclasses.asdict(dataclasses.replace(LAYOUT, block_size=16))
    problem = replicas._check_layout(replicas.replicas["b"], other)
    assert problem is not None and "differs from the other replicas'" in problem and "block keys" in problem


@pytest.mark.parametrize(("text", "spec"), [
    ("http://h:1", ReplicaSpec("h:1", "http://h:1")),
    ("http://h:1/,events=tcp://h:2,replay=tcp://h:3,name=r", ReplicaSpec("r", "http://h:1", "tcp://h:2", "tcp://h:3")),
])
def test_replica_specs(text: str, spec: ReplicaSpec) -> None:
    assert parse_replica(text) == spec


@pytest.mark.parametrize(("text", "bad"), [("h:1", "is not an http(s)://HOST:PORT URL"),
                                           ("http://h:1,event=tcp://x", "'event=tcp://x' is not"),
                                           ("http://h:1,name=", "'name=' is not")])
def test_bad_replica_specs_name_the_part(text: str, bad: str) -> None:
    with pytest.raises(ValueError, match="--replica") as exc:
        parse_replica(text)
    assert bad in str(exc.value)


def test_two_replicas_with_one_name_are_refused() -> None:
    with pytest.raises(ValueError, match="two replicas are named 'x'"):
        ReplicaSet([ReplicaSpec("x", "http://a"), ReplicaSpec("x", "http://b")], interval=1)


@pytest.mark.parametrize(("text", "spec"), [
    ("events=tcp://d:5559", StoreSpec("d:5559", "tcp://d:5559")),
    ("events=tcp://d:1,replay=tcp://d:2,name=daemon,serves=a+b", StoreSpec("daemon", "tcp://d:1", "tcp://d:2", ("a", "b"))),
])
def test_store_specs(text: str, spec: StoreSpec) -> None:
    assert parse_store(text, ["a", "b"]) == spec


@pytest.mark.parametrize(("text", "bad"), [
    ("replay=tcp://d:2", "events=ENDPOINT is missing"),
    ("events=tcp://d:1,serves=a+c", "serves names c, not a replica (replicas: a, b)"),
    ("events=tcp://d:1,name=a", "'a' is a replica's name"),
    ("events=tcp://d:1,events=tcp://d:2", "'events=tcp://d:2' is not"),
    ("events=tcp://d:1,host=x", "'host=x' is not"),
])
def test_bad_store_specs_name_the_part(text: str, bad: str) -> None:
    with pytest.raises(ValueError, match="--store") as exc:
        parse_store(text, ["a", "b"])
    assert bad in str(exc.value)
