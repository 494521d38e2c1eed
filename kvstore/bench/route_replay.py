"""Replay a trace against simulated replicas under one router: a discrete-event simulation.

Events on one clock (trace time): a request arrives and the router chooses (its decision is timed
on the wall clock); a replica starts a prefill (cache lookup and insert, the store's events queued);
the replica's events reach the router ``event_lag_s`` after the prefill ends (what a real replica
publishes once the blocks are computed); the first token comes out (TTFT); decode ends. The
router's load accounting is its own, as a proxy's is: a request is in flight from its choice to
its last token, and its uncached prompt tokens (as the router estimated them) until its first.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np

from kvstore.bench.route_policies import keys_of
from kvstore.bench.route_sim import ReplicaModel, SimReplica
from kvstore.bench.workloads import Request
from kvstore.events import StoreEvent
from kvstore.route.policy import ReplicaLoad


class Router(Protocol):
    """What the replay asks of a router."""

    def choose(self, req: Request, keys: list[bytes], loads: dict[str, ReplicaLoad]) -> tuple[str, int]: ...

    def ingest(self, replica: str, events: list[StoreEvent]) -> None: ...


@dataclass
class ReplayResult:
    """What one replay measured."""

    ttft_s: np.ndarray
    hit_tokens: int
    prompt_tokens: int
    requests_per_replica: dict[str, int]
    decision_s: np.ndarray
    """Wall time of each routing decision (includes being descheduled on a loaded machine)."""
    decision_cpu_s: np.ndarray
    """CPU time of each routing decision (the router's own work)."""

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from a replica's cache (GPU or host) / prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay(requests: list[Request], arrivals_s: list[float], outputs: list[int], names: list[str],
           model: ReplicaModel, make_router: Callable[[list[str]], Router], event_lag_s: float = 0.05) -> ReplayResult:
    """Replay ``requests`` (arriving at ``arrivals_s``, decoding ``outputs`` tokens) on ``names`` replicas."""
    replicas = {n: SimReplica(n, model) for n in names}
    router = make_router(names)
    loads = {n: ReplicaLoad() for n in names}
    busy = dict.fromkeys(names, False)
    heap: list[tuple[float, int, str, object]] = []
    tick = itertools.count()
    for i, t in enumerate(arrivals_s):
        heapq.heappush(heap, (t, next(tick), "arrive", i))
    n = len(requests)
    ttft = np.zeros(n)
    decision = np.zeros(n)
    decision_cpu = np.zeros(n)
    estimate = [0] * n
    hit_tokens = 0
    bt = model.block_tokens

    def start(name: str, now: float) -> None:
        nonlocal hit_tokens
        rep = replicas[name]
        i = rep.queue.popleft()
        busy[name] = True
        gpu, lower, prefill_s = rep.start(requests[i])
        hit_tokens += (gpu + lower) * bt
        end = now + prefill_s
        events = rep.drain_events()
        if events:
            heapq.heappush(heap, (end + event_lag_s, next(tick), "events", (name, events)))
        heapq.heappush(heap, (end, next(tick), "first", (name, i)))

    while heap:
        now, _, kind, x = heapq.heappop(heap)
        if kind == "arrive":
            i = cast(int, x)
            req = requests[i]
            keys = keys_of(req)
            t0, c0 = time.perf_counter(), time.thread_time()
            name, cached = router.choose(req, keys, loads)
            decision[i] = time.perf_counter() - t0
            decision_cpu[i] = time.thread_time() - c0
            estimate[i] = max(req.prompt_tokens - cached * bt, 0)
            loads[name].in_flight_requests += 1
            loads[name].in_flight_tokens += estimate[i]
            replicas[name].queue.append(i)
            replicas[name].requests += 1
            if not busy[name]:
                start(name, now)
        elif kind == "first":
            name, i = cast(tuple[str, int], x)
            ttft[i] = now - arrivals_s[i]
            loads[name].in_flight_tokens -= estimate[i]
            heapq.heappush(heap, (now + outputs[i] * model.decode_s_per_token, next(tick), "done", name))
            busy[name] = False
            if replicas[name].queue:
                start(name, now)
        elif kind == "events":
            name, events = cast(tuple[str, list[StoreEvent]], x)
            router.ingest(name, events)
        else:
            loads[cast(str, x)].in_flight_requests -= 1
    return ReplayResult(ttft, hit_tokens, sum(r.prompt_tokens for r in requests),
                        {n: r.requests for n, r in replicas.items()}, decision, decision_cpu)
