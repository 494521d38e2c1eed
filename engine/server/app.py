"""The engine server's HTTP application: OpenAI ``/v1/completions`` and ``/v1/chat/completions``,
``/health``, ``/metrics`` (Prometheus text), ``/stats`` (the same figures as JSON) and ``/v1/models``.

Every response names the replica in the ``x-kvstore-replica`` header.
``/health`` also returns the KV layout the replica's block keys are rooted in,
so a router computes identical keys (``kvstore route`` reads it from there).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from engine.sampling_params import SamplingParams
from engine.server.prompt import PromptRenderer
from engine.server.responses import SSE_DONE, ResponseWriter, error_body
from engine.server.metrics import engine_families
from engine.server.worker import Delta, EngineWorker
from kvstore.layout import KVLayout
from kvstore.util.prometheus import CONTENT_TYPE, render
from kvstore.route.openai_request import CompletionRequest, RequestError, RequestKind, parse_request

REPLICA_HEADER = "x-kvstore-replica"


def bad_request(message: str, param: str | None = None, status: int = 400) -> web.Response:
    """An OpenAI-shaped error response."""
    return web.json_response(error_body(message, param), status=status)


class EngineServer:
    """The handlers over one :class:`EngineWorker`. ``extra_metrics`` adds sections to ``/stats`` and
    ``/metrics`` (events)."""

    def __init__(self, worker: EngineWorker, renderer: PromptRenderer, model_name: str, replica_id: str,
                 layout: KVLayout, extra_metrics: Callable[[], dict[str, Any]] | None = None,
                 aliases: tuple[str, ...] = ()) -> None:
        """``model_name``: the name ``/v1/models`` lists and responses carry; a request may also name the model
        by one of ``aliases`` (the command-line name it was started with)."""
        self.worker = worker
        self.aliases = aliases
        self.renderer = renderer
        self.model_name = model_name
        self.replica_id = replica_id
        self.layout = layout
        self.extra_metrics = extra_metrics
        self.instance = uuid.uuid4().hex
        """This process's identity in ``/health``: a router that sees it change knows the replica restarted."""

    def app(self) -> web.Application:
        """The aiohttp application (the caller starts and stops the worker)."""

        @web.middleware
        async def tag(request: web.Request, handler: Any) -> web.StreamResponse:
            response: web.StreamResponse = await handler(request)
            if not response.prepared:  # a stream already sent its headers (set there)
                response.headers[REPLICA_HEADER] = self.replica_id
            return response

        app = web.Application(middlewares=[tag])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/stats", self.stats)
        app.router.add_get("/v1/models", self.models)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve("completion", request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve("chat", request)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok" if self.worker.failure is None else "failed",
                                  "replica": self.replica_id, "instance": self.instance, "model": self.model_name,
                                  "kv_layout": dataclasses.asdict(self.layout)},
                                 status=200 if self.worker.failure is None else 503)

    def snapshot(self) -> dict[str, Any]:
        """Every figure ``/stats`` and ``/metrics`` report, read once."""
        load = self.worker.load()
        pool = self.worker.llm.pool
        body: dict[str, Any] = {"replica": self.replica_id, "in_flight_requests": load.in_flight_requests,
                                "in_flight_tokens": load.in_flight_tokens, "totals": dict(self.worker.totals),
                                "gpu_blocks": {"total": pool.num_blocks, "used": pool.num_blocks - pool.num_free}}
        if self.extra_metrics is not None:
            body.update(self.extra_metrics())
        return body

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot())

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=render(engine_families(self.snapshot())), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "kvstore"}]})

    # ----------------------------------------------------------------- serving
    async def _parse(self, kind: RequestKind, request: web.Request) -> tuple[CompletionRequest, list[int]]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(None, f"the request body is not JSON: {exc}") from exc
        req = parse_request(kind, body)
        if req.model is not None and req.model != self.model_name and req.model not in self.aliases:
            raise RequestError("model", f"'model' {req.model!r} is not served here; this replica serves "
                               f"{self.model_name!r}")
        return req, self.renderer.token_ids(req)

    async def _serve(self, kind: RequestKind, request: web.Request) -> web.StreamResponse:
        try:
            req, ids = await self._parse(kind, request)
            params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k,
                                    top_p=req.top_p, seed=req.seed, stop=req.stop, ignore_eos=req.ignore_eos)
        except RequestError as exc:
            return bad_request(str(exc), exc.param)
        except ValueError as exc:  # SamplingParams' own checks (an empty stop string)
            return bad_request(str(exc))
        try:
            deltas = self.worker.submit(ids, params, req.cache_salt)
            first = await anext(deltas)
        except RuntimeError as exc:
            return bad_request(str(exc), status=503)
        if first.error is not None:
            return bad_request(first.error, "prompt" if "prompt" in first.error else None)
        writer = ResponseWriter(kind, uuid.uuid4().hex[:24], self.model_name)
        if not req.stream:
            text, last = first.text, first
            async for delta in deltas:
                text, last = text + delta.text, delta
            return self._whole(writer, text, last)
        return await self._stream(request, writer, req, first, deltas)

    def _whole(self, writer: ResponseWriter, text: str, last: Delta) -> web.Response:
        if last.error is not None or last.usage is None:
            return web.json_response(error_body(last.error or "the request ended without a result", kind="server_error"),
                                     status=500)
        return web.json_response(writer.whole(text, last.finish_reason, last.usage))

    async def _stream(self, request: web.Request, writer: ResponseWriter, req: CompletionRequest, first: Delta,
                      deltas: Any) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               REPLICA_HEADER: self.replica_id})
        await response.prepare(request)
        delta, is_first = first, True
        while True:
            if delta.error is not None:
                await response.write(b"data: " + json.dumps(error_body(delta.error, kind="server_error")).encode()
                                     + b"\n\n")
                break
            if delta.text or delta.finish_reason is not None or is_first:
                await response.write(writer.chunk(delta.text, delta.finish_reason, first=is_first))
                is_first = False
            if delta.finish_reason is not None:
                if req.include_usage and delta.usage is not None:
                    await response.write(writer.usage_chunk(delta.usage))
                break
            delta = await anext(deltas)
        await response.write(SSE_DONE)
        await response.write_eof()
        return response

