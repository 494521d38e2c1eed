"""``kvstore route``'s HTTP front: OpenAI passthrough to the replica the policy picks, ``POST /route``, ``/metrics`` (``/stats``: JSON).

Per request::

    body --parse_request--> CompletionRequest --token_ids--> prompt tokens
         --prompt_keys(layout from the replicas' /health, vLLM replicas' schemes, cache_salt)--> keys per scheme
         --cached_prefixes (RouterIndex.cached_prefix per scheme)--> hit per replica, in its own blocks
         --CostPolicy.choose(hits, loads of the replicas that are up, block scales)--> replica
         --forward (SSE streamed through as it arrives)--> client

A replica that refuses the connection (or answers 502-504) before any byte
reached the client is marked down and the request goes to the next choice;
once a response has started it is passed through as it is. The tokenizer is
injected (``token_ids``) because kvstore's core does not import the engine:
``kvstore route`` builds it from the served model.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvstore.util.prometheus import CONTENT_TYPE, render
from kvstore.route.index import RouterIndex
from kvstore.route.metrics import route_families
from kvstore.route.openai_request import CompletionRequest, RequestError, RequestKind, parse_request
from kvstore.route.policy import CostPolicy, Decision
from kvstore.route.prompt_keys import PromptKeys, block_scales, cached_prefixes, prompt_keys
from kvstore.route.replica_set import ReplicaSet

ROUTED_HEADER = "x-kvstore-routed-to"
"""Response header naming the replica the router sent the request to."""
HIT_HEADER = "x-kvstore-hit-blocks"
"""Response header: prompt blocks the router's index found cached on that replica."""
_RETRY_STATUSES = (502, 503, 504)


def error_response(message: str, param: str | None = None, status: int = 400) -> web.Response:
    """An OpenAI-shaped error."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                             status=status)


@dataclass
class RouteStats:
    """What ``/stats`` and ``/metrics`` report about decisions (changed only by :class:`Router`)."""

    decisions: int = 0
    by_replica: dict[str, int] = field(default_factory=dict)
    prompt_blocks: int = 0
    """Prompt blocks of the decisions, each in its chosen replica's blocks (a vLLM replica's may be larger)."""
    hit_blocks: int = 0
    hit_histogram: dict[str, int] = field(default_factory=dict)
    """Decisions by hit blocks, bucketed 0, 1-3, 4-15, 16-63, 64+."""
    retries: int = 0
    failed: int = 0
    decision_seconds_total: float = 0.0
    decision_seconds_max: float = 0.0

    def record(self, decision: Decision, prompt_blocks: int, seconds: float) -> None:
        """Count one decision."""
        self.decisions += 1
        self.by_replica[decision.replica] = self.by_replica.get(decision.replica, 0) + 1
        self.prompt_blocks += prompt_blocks
        hit = decision.hit.blocks
        self.hit_blocks += hit
        bucket = "0" if hit == 0 else "1-3" if hit < 4 else "4-15" if hit < 16 else "16-63" if hit < 64 else "64+"
        self.hit_histogram[bucket] = self.hit_histogram.get(bucket, 0) + 1
        self.decision_seconds_total += seconds
        self.decision_seconds_max = max(self.decision_seconds_max, seconds)


class Router:
    """The proxy's handlers over a :class:`ReplicaSet`, a :class:`RouterIndex` and a :class:`CostPolicy`.

    ``token_ids`` turns a parsed request into the token ids the replicas will
    run (the served model's chat template and tokenizer); ``event_stats``
    gives the ``events`` section of ``/stats`` (the subscriber's lag and
    losses). ``index_lock`` is the lock the subscriber changes the index under
    (:attr:`EventSubscriber.lock`); lookups take it too.
    """

    def __init__(self, replicas: ReplicaSet, index: RouterIndex, policy: CostPolicy,
                 token_ids: Callable[[CompletionRequest], list[int]], index_lock: threading.Lock,
                 event_stats: Callable[[], dict[str, Any]] | None = None, connect_timeout: float = 2.0) -> None:
        self.replicas = replicas
        self.index = index
        self.index_lock = index_lock
        self.policy = policy
        self.token_ids = token_ids
        self.event_stats = event_stats
        self.stats = RouteStats()
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        """The aiohttp application; its startup opens the client session and starts polling the replicas."""
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/route", self.route)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/stats", self.stats_view)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        await self.replicas.start(self._session)

    async def _cleanup(self, app: web.Application) -> None:
        await self.replicas.stop()
        if self._session is not None:
            await self._session.close()

    # ----------------------------------------------------------------- deciding
    def keys(self, req: CompletionRequest) -> PromptKeys:
        """The request's token ids and block keys under every scheme in the fleet (no kvstore keys before any
        kvstore replica reported its layout)."""
        specs = [r.spec for r in self.replicas.replicas.values()]
        return prompt_keys(self.token_ids(req), specs, self.replicas.layout, req.cache_salt, req.model)

    def decide(self, keys: PromptKeys, exclude: set[str] = frozenset()) -> Decision | None:  # type: ignore[assignment]  # a frozenset default is never mutated
        """The policy's choice among the replicas that are up and not in ``exclude``; None when there is none."""
        started = time.perf_counter()
        loads = {n: load for n, load in self.replicas.loads().items() if load.up and n not in exclude}
        if not loads:
            return None
        specs = [self.replicas.replicas[n].spec for n in loads]
        with self.index_lock:
            hits = cached_prefixes(self.index, keys, specs)
            held = {n: self.index.blocks(n) for n in loads}
        decision = self.policy.choose(keys.unit_blocks, hits, loads, block_scales(keys, specs), held)
        prompt_blocks = len(keys.of(self.replicas.replicas[decision.replica].spec))
        self.stats.record(decision, prompt_blocks, time.perf_counter() - started)
        return decision

    def _none_up(self) -> web.Response:
        reasons = "; ".join(f"{n}: {r.reason}" for n, r in self.replicas.replicas.items())
        self.stats.failed += 1
        return error_response(f"no replica can take the request ({reasons})", status=503)

    async def _parse(self, kind: RequestKind, request: web.Request) -> tuple[bytes, CompletionRequest]:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(None, f"the request body is not JSON: {exc}") from exc
        if kind == "completion" and isinstance(body, dict) and "messages" in body and "prompt" not in body:
            kind = "chat"  # POST /route takes either shape
        return raw, parse_request(kind, body)

    # ----------------------------------------------------------------- handlers
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._forward("completion", "/v1/completions", request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._forward("chat", "/v1/chat/completions", request)

    async def route(self, request: web.Request) -> web.Response:
        """The replica a completion or chat body would go to (for callers that forward themselves; not counted
        as in flight)."""
        try:
            _, req = await self._parse("completion", request)
            keys = self.keys(req)
        except RequestError as exc:
            return error_response(str(exc), exc.param)
        decision = self.decide(keys)
        if decision is None:
            return self._none_up()
        spec = self.replicas.replicas[decision.replica].spec
        return web.json_response({
            "replica": decision.replica, "url": spec.url, "prompt_tokens": len(keys.token_ids),
            "prompt_blocks": len(keys.of(spec)), "hit_blocks": decision.hit.blocks,
            "hit_by_tier": decision.hit.by_tier, "costs": decision.costs})

    async def _forward(self, kind: RequestKind, path: str, request: web.Request) -> web.StreamResponse:
        try:
            raw, req = await self._parse(kind, request)
            keys = self.keys(req)
        except RequestError as exc:
            return error_response(str(exc), exc.param)
        assert self._session is not None
        tokens = len(keys.token_ids) + req.max_tokens
        tried: set[str] = set()
        while True:
            decision = self.decide(keys, tried)
            if decision is None:
                return self._none_up()
            name = decision.replica
            url = self.replicas.replicas[name].spec.url + path
            self.replicas.begin(name, tokens)
            try:
                try:
                    upstream = await self._session.post(url, data=raw, headers={"Content-Type": "application/json"})
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                    self.replicas.mark_down(name, f"{url}: {type(exc).__name__}: {exc}")
                    tried.add(name)
                    self.stats.retries += 1
                    continue
                async with upstream:
                    if upstream.status in _RETRY_STATUSES:
                        self.replicas.mark_down(name, f"{url} answered {upstream.status}")
                        tried.add(name)
                        self.stats.retries += 1
                        continue
                    return await self._pass_through(request, upstream, decision)
            finally:
                self.replicas.end(name, tokens)

    async def _pass_through(self, request: web.Request, upstream: aiohttp.ClientResponse,
                            decision: Decision) -> web.StreamResponse:
        headers = {ROUTED_HEADER: decision.replica, HIT_HEADER: str(decision.hit.blocks),
                   "Content-Type": upstream.headers.get("Content-Type", "application/json")}
        for name in ("x-kvstore-replica", "Cache-Control"):
            if name in upstream.headers:
                headers[name] = upstream.headers[name]
        if upstream.content_type != "text/event-stream":
            return web.Response(status=upstream.status, body=await upstream.read(), headers=headers)
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # the replica died mid-stream: say so, end
            self.replicas.mark_down(decision.replica, f"stream broke: {type(exc).__name__}: {exc}")
            self.stats.failed += 1
            err = {"error": {"message": f"replica {decision.replica} failed mid-stream: {exc}", "type": "server_error",
                             "param": None, "code": None}}
            await response.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        await response.write_eof()
        return response

    async def health(self, request: web.Request) -> web.Response:
        up = [n for n, r in self.replicas.replicas.items() if r.up]
        return web.json_response({"status": "ok" if up else "no replica up", "replicas_up": up},
                                 status=200 if up else 503)

    def snapshot(self) -> dict[str, Any]:
        """Every figure ``/stats`` and ``/metrics`` report, read once."""
        s = self.stats
        body: dict[str, Any] = {
            "decisions": s.decisions, "retries": s.retries, "failed": s.failed,
            "prompt_blocks": s.prompt_blocks, "hit_blocks": s.hit_blocks,
            "hit_blocks_per_decision": s.hit_blocks / s.decisions if s.decisions else 0.0,
            "hit_blocks_histogram": dict(s.hit_histogram),
            "decision_seconds_total": s.decision_seconds_total,
            "decision_seconds": {"mean": s.decision_seconds_total / s.decisions if s.decisions else 0.0,
                                 "max": s.decision_seconds_max},
            "replicas": {n: {"url": r.spec.url, "up": r.up, "reason": r.reason, "decisions": s.by_replica.get(n, 0),
                             "in_flight_requests": r.requests, "in_flight_tokens": r.tokens,
                             "reported_in_flight_requests": r.reported.in_flight_requests,
                             "reported_in_flight_tokens": r.reported.in_flight_tokens}
                         for n, r in self.replicas.replicas.items()},
        }
        if self.event_stats is not None:
            body["events"] = self.event_stats()
        return body

    async def stats_view(self, request: web.Request) -> web.Response:
        return web.json_response(self.snapshot())

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=render(route_families(self.snapshot())), headers={"Content-Type": CONTENT_TYPE})
