"""``kvstore engine serve``'s application in-process: OpenAI bodies, streaming, cached tokens, errors, load.

The built-in tiny model over an embedded store with a host tier only (no
files); requests go through aiohttp's test client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from connectors.embedded import EmbeddedConnector
from engine import LLM, EngineConfig
from engine.default_model import served_name
from engine.model_text import ModelText
from engine.server.app import REPLICA_HEADER, EngineServer
from engine.server.prompt import PromptRenderer
from engine.server.worker import EngineWorker
from kvstore.config.schema import KVStoreConfig

BS = 4


def _server() -> tuple[EngineServer, EmbeddedConnector]:
    connector = EmbeddedConnector(KVStoreConfig.model_validate({"tiers": ["host"], "host": {"capacity": "1MiB"}}))
    llm = LLM(None, config=EngineConfig(block_size=BS, num_gpu_blocks=64, device="cpu"), connector=connector)
    server = EngineServer(EngineWorker(llm), PromptRenderer(ModelText(llm.tokenizer, llm.chat_template)),
                          served_name("builtin"), "r0", llm.pool.layout, aliases=("builtin",))
    return server, connector


def _run(test: Callable[[TestClient, EngineServer], Awaitable[None]], start: bool = True) -> None:
    async def main() -> None:
        server, connector = _server()
        if start:
            server.worker.start()
        client = TestClient(TestServer(server.app()))
        await client.start_server()
        try:
            await test(client, server)
        finally:
            await client.close()
            server.worker.close()
            connector.close()

    asyncio.run(main())


async def _events(resp: Any) -> AsyncIterator[Any]:
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: ")
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)


def test_completion_reports_the_prompt_tokens_served_from_the_cache() -> None:
    prompt = "abcdefghijklmno"  # BOS + 15 bytes = 16 tokens = 4 blocks of 4

    async def test(client: TestClient, server: EngineServer) -> None:
        body = {"model": "builtin", "prompt": prompt, "max_tokens": 3, "temperature": 0}
        first = await client.post("/v1/completions", json=body)
        assert first.status == 200 and first.headers[REPLICA_HEADER] == "r0"
        one = await first.json()
        assert one["object"] == "text_completion" and one["choices"][0]["finish_reason"] == "length"
        assert one["usage"] == {"prompt_tokens": 16, "completion_tokens": 3, "total_tokens": 19,
                                "prompt_tokens_details": {"cached_tokens": 0}}
        two = await (await client.post("/v1/completions", json=body)).json()
        # All full blocks but the one holding the last prompt token: 3 blocks of 4.
        assert two["usage"]["prompt_tokens_details"] == {"cached_tokens": 12}
        assert two["choices"][0]["text"] == one["choices"][0]["text"]

    _run(test)


def test_chat_streams_chunks_then_usage_then_done() -> None:
    async def test(client: TestClient, server: EngineServer) -> None:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        events = [e async for e in _events(resp)]
        assert events[-1] == "[DONE]"
        chunks, usage = events[:-2], events[-2]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
        whole = await (await client.post("/v1/chat/completions", json={**body, "stream": False})).json()
        streamed = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        assert whole["choices"][0]["message"] == {"role": "assistant", "content": streamed}
        # The fallback template renders the same turn the same way: its prompt is cached now.
        assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    _run(test)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "model": "other"}, "model"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
])
def test_a_bad_request_is_a_400_naming_the_field(path: str, body: dict[str, Any], param: str) -> None:
    async def test(client: TestClient, server: EngineServer) -> None:
        resp = await client.post(path, json=body)
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error"
        assert f"'{param.split('.')[-1].split('[')[0]}" in err["message"] or param in err["message"]

    _run(test)


def test_a_prompt_too_long_for_the_model_is_refused_not_queued() -> None:
    async def test(client: TestClient, server: EngineServer) -> None:
        resp = await client.post("/v1/completions", json={"prompt": "x" * 300, "max_tokens": 8})
        assert resp.status == 400
        assert "KV blocks" in (await resp.json())["error"]["message"]
        assert server.worker.load().in_flight_requests == 0

    _run(test)


def test_health_names_the_layout_and_metrics_count_in_flight_work() -> None:
    async def test(client: TestClient, server: EngineServer) -> None:
        health = await (await client.get("/health")).json()
        assert health["status"] == "ok" and health["replica"] == "r0"
        assert health["kv_layout"]["block_size"] == BS and health["kv_layout"]["model_id"] == "builtin-random-seed0"
        # The engine thread is not started yet: the request waits in the queue, counted as in flight.
        pending = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 40,
                                                                             "ignore_eos": True}))
        for _ in range(500):
            metrics = await (await client.get("/stats")).json()
            if metrics["in_flight_requests"]:
                break
            await asyncio.sleep(0.01)
        assert metrics["in_flight_requests"] == 1 and metrics["in_flight_tokens"] == 4 + 40
        server.worker.start()
        assert (await (await pending).json())["usage"]["completion_tokens"] == 40
        metrics = await (await client.get("/stats")).json()
        assert metrics["in_flight_requests"] == 0 and metrics["in_flight_tokens"] == 0
        assert metrics["totals"] == {"requests": 1, "prompt_tokens": 4, "cached_tokens": 0, "generated_tokens": 40,
                                     "refused": 0}

    _run(test, start=False)


def test_a_client_that_goes_away_aborts_its_request() -> None:
    async def test(client: TestClient, server: EngineServer) -> None:
        resp = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 200, "ignore_eos": True,
                                                          "stream": True})
        await resp.content.readline()  # the stream has started
        resp.close()
        for _ in range(500):
            if server.worker.load().in_flight_requests == 0:
                break
            await asyncio.sleep(0.01)
        assert server.worker.load().in_flight_requests == 0
        assert server.worker.totals["requests"] == 0  # aborted, not finished
        assert not server.worker.llm.has_unfinished()

    _run(test)


def test_the_server_names_its_model_and_takes_the_name_it_was_started_with() -> None:
    assert (served_name("default"), served_name("builtin"), served_name("/m/llama")) == (
        "SmolLM2-135M-Instruct", "builtin-random", "/m/llama")

    async def test(client: TestClient, server: EngineServer) -> None:
        models = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["builtin-random"]  # says its answers are noise
        for name in ("builtin-random", "builtin"):
            resp = await client.post("/v1/completions", json={"model": name, "prompt": "ab", "max_tokens": 1})
            assert resp.status == 200 and (await resp.json())["model"] == "builtin-random"
        resp = await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "ab", "max_tokens": 1})
        assert resp.status == 400 and "'builtin-random'" in (await resp.json())["error"]["message"]

    _run(test)
