"""kvstore's figures in vLLM's own ``/metrics``: breakers, misses by reason, dropped saves, load decisions.

vLLM collects each connector's :class:`KVConnectorStats` from the scheduler
(every step) and from the workers (in their step output), adds them up and
hands them to the connector's Prometheus class in the API server process.
kvstore's side is :meth:`HealthReport.take`: what changed since the last
report, from each daemon tier's :meth:`~kvstore.daemon.client.tier.DaemonTier.health`
and the worker's save queue. An operator sees there that a stalled daemon
was cut off (``vllm:kvstore_breaker_open``) and what it cost
(``vllm:kvstore_misses_total`` by operation and reason).

Series (labels after vLLM's per-engine ones):

- ``vllm:kvstore_breaker_open{side}`` (gauge): 1 while that side's breaker is open.
- ``vllm:kvstore_breaker_opened_total{side}``: times it opened.
- ``vllm:kvstore_misses_total{op,reason}``: calls (``lookup``, ``load``, ``save``) that gave nothing.
- ``vllm:kvstore_missed_blocks_total{op,reason}``: blocks not loaded or not saved, ``save``'s ``queue_full`` included.
- ``vllm:kvstore_load_decisions_total{decision}``: matches loaded (``load``) or left to vLLM to compute
  (``recompute``: expected to arrive later than vLLM computes them, :mod:`kvstore.store.load_cost`).
- ``vllm:kvstore_load_step_seconds_total{step}``: time loads spent in each step: ``probe`` (the scheduler
  asking kvstore what it holds), ``read`` (copying the blocks out of kvstore's tiers: the daemon's arena or
  disk), ``write`` (into vLLM's KV cache).
- ``vllm:kvstore_load_bandwidth_bytes_per_second``, ``vllm:kvstore_load_latency_seconds``,
  ``vllm:kvstore_prefill_tokens_per_second`` (gauges): the inputs of those decisions, as measured.

The workers' measured load rate also reaches the scheduler this way (:func:`worker_clock` of the stats in
each step's output), which decides from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics, KVConnectorStats, PromMetric, PromMetricT,
)

from connectors.engine_store import EngineBlockStore
from connectors.save_queue import SaveQueue
from kvstore.store.load_cost import LoadCost


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """One interval's figures: ``misses`` ``{"op|reason": [calls, blocks]}`` (added up), ``breakers``
    ``{side: [open, opened]}`` (``open`` the latest, ``opened`` added up), ``decisions`` ``{"load": n,
    "recompute": n}`` (added up), ``clock`` ``[bandwidth, latency]`` (a worker's measured loads: the slowest
    worker's), ``prefill`` (the scheduler's measured tokens per second, the latest)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"misses": {}, "breakers": {}}

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in ("misses", "breakers", "decisions", "clock", "prefill", "forward",
                                                  "steps"))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, (calls, blocks) in other.data.get("misses", {}).items():
            mine = self.data.setdefault("misses", {}).setdefault(key, [0, 0])
            mine[0] += calls
            mine[1] += blocks
        for side, (is_open, opened) in other.data.get("breakers", {}).items():
            prev = self.data.setdefault("breakers", {}).get(side, [0, 0])
            self.data["breakers"][side] = [is_open, prev[1] + opened]
        for decision, n in other.data.get("decisions", {}).items():
            mine = self.data.setdefault("decisions", {})
            mine[decision] = mine.get(decision, 0) + n
        for step, seconds in other.data.get("steps", {}).items():
            steps = self.data.setdefault("steps", {})
            steps[step] = steps.get(step, 0.0) + seconds
        if other.data.get("clock"):
            mine_clock = self.data.get("clock")
            theirs = other.data["clock"]
            self.data["clock"] = theirs if not mine_clock else [min(mine_clock[0], theirs[0]),
                                                                max(mine_clock[1], theirs[1])]
        if other.data.get("prefill"):
            self.data["prefill"] = other.data["prefill"]
        if other.data.get("forward"):
            mine_fwd = self.data.get("forward") or [0, 0.0]
            self.data["forward"] = [mine_fwd[0] + other.data["forward"][0], mine_fwd[1] + other.data["forward"][1]]
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, (calls, blocks) in sorted(self.data.get("misses", {}).items()):
            out[f"miss_{key.replace('|', '_')}"] = calls
            out[f"miss_{key.replace('|', '_')}_blocks"] = blocks
        for side, (is_open, opened) in sorted(self.data.get("breakers", {}).items()):
            out[f"breaker_{side}_open"] = is_open
            out[f"breaker_{side}_opened"] = opened
        for decision, n in sorted(self.data.get("decisions", {}).items()):
            out[f"decided_{decision}"] = n
        for step, seconds in sorted(self.data.get("steps", {}).items()):
            out[f"load_{step}_ms"] = round(seconds * 1e3, 2)
        if self.data.get("clock"):
            out["load_bandwidth_MBps"] = round(self.data["clock"][0] / 1e6, 1)
            out["load_latency_ms"] = round(self.data["clock"][1] * 1e3, 2)
        if self.data.get("prefill"):
            out["prefill_tokens_per_s"] = round(self.data["prefill"], 1)
        return out


def worker_forward(stats: KVConnectorStats | None) -> tuple[int, float] | None:
    """Tokens and seconds of the forwards the workers measured in ``stats`` (a step's output), if any."""
    forward = stats.data.get("forward") if stats is not None else None
    return (int(forward[0]), float(forward[1])) if forward else None


def worker_clock(stats: KVConnectorStats | None) -> tuple[float, float] | None:
    """The load bandwidth and latency the workers reported in ``stats`` (a step's output), if they did."""
    clock = stats.data.get("clock") if stats is not None else None
    return (float(clock[0]), float(clock[1])) if clock else None


class HealthReport:
    """What one side of the connector (``side``: ``scheduler`` or ``worker N``) reports to vLLM, as deltas."""

    def __init__(self, side: str, store: EngineBlockStore, save_queue: SaveQueue | None = None,
                 cost: LoadCost | None = None, forward: list[Any] | None = None,
                 steps: dict[str, float] | None = None) -> None:
        """``forward``: a worker's ``[tokens, seconds]`` of forwards, reported as they grow (``forward``).
        ``steps``: seconds this side's loads spent per step, reported as they grow (``steps``)."""
        self.side = side
        self.store = store
        self.save_queue = save_queue
        self.cost = cost
        self._seen_misses: dict[str, list[int]] = {}
        self._seen_opened = 0
        self._was_open = -1
        self._seen_decisions: dict[str, int] = {}
        self._seen_measured = 0
        self._seen_prefill: float | None = None
        self.forward = forward
        self._seen_forward = [0, 0.0]
        self.steps = steps
        self._seen_steps: dict[str, float] = {}

    def take(self) -> KVStoreConnectorStats | None:
        """The figures that changed since the last call (``None``: nothing did)."""
        totals: dict[str, list[int]] = {}
        is_open, opened = 0, 0
        extra: dict[str, Any] = {}
        healths = self.store.health()
        measured = sum(int(h.get("measured_loads", 0)) for h in healths)  # type: ignore[call-overload]
        if self.cost is None and measured != self._seen_measured:  # a worker: what its loads measured
            self._seen_measured = measured
            extra["clock"] = [min(float(h["load_bandwidth_bytes_per_s"]) for h in healths),  # type: ignore[arg-type]
                              max(float(h["load_latency_s"]) for h in healths)]  # type: ignore[arg-type]
        if self.forward is not None and self.forward[0] != self._seen_forward[0]:
            extra["forward"] = [self.forward[0] - self._seen_forward[0], self.forward[1] - self._seen_forward[1]]
            self._seen_forward = list(self.forward)
        if self.steps is not None:
            grown = {k: v - self._seen_steps.get(k, 0.0) for k, v in self.steps.items()}
            if any(grown.values()):
                extra["steps"] = {k: v for k, v in grown.items() if v}
                self._seen_steps = dict(self.steps)
        if self.cost is not None:  # the scheduler: its decisions and the prefill rate from the workers
            decisions = dict(self.cost.decisions)
            delta = {k: n - self._seen_decisions.get(k, 0) for k, n in decisions.items()}
            if any(delta.values()):
                extra["decisions"] = delta
                self._seen_decisions = decisions
            if self.cost.prefill_rate != self._seen_prefill:
                self._seen_prefill = self.cost.prefill_rate
                extra["prefill"] = self.cost.prefill_rate
                extra["clock"] = [self.cost.clock.bandwidth, self.cost.clock.latency]
        for health in healths:
            for row in health.get("misses", []):  # type: ignore[union-attr]
                key = f"{row['op']}|{row['reason']}"
                t = totals.setdefault(key, [0, 0])
                t[0] += int(row["calls"])
                t[1] += int(row["blocks"])
            is_open = max(is_open, int(health.get("state") == "open"))
            opened += int(health.get("opened", 0))  # type: ignore[call-overload]
        if self.save_queue is not None:
            for reason, n in self.save_queue.stats()["dropped"].items():  # type: ignore[attr-defined]
                if reason == "queue_full":  # the others were counted by the tier the writer asked
                    totals[f"save|{reason}"] = [n, n]
        misses = {}
        for key, (calls, blocks) in totals.items():
            seen = self._seen_misses.get(key, [0, 0])
            if calls != seen[0] or blocks != seen[1]:
                misses[key] = [calls - seen[0], blocks - seen[1]]
        self._seen_misses = totals
        breakers = {}
        if opened != self._seen_opened or is_open != self._was_open:
            breakers[self.side] = [is_open, opened - self._seen_opened]
            self._seen_opened, self._was_open = opened, is_open
        if not misses and not breakers and not extra:
            return None
        return KVStoreConnectorStats(data={"misses": misses, "breakers": breakers, **extra})


class KVStorePromMetrics(KVConnectorPromMetrics):
    """The series of the module docstring, per vLLM engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._open = self._gauge_cls(name="vllm:kvstore_breaker_open", documentation="1 while kvstore's circuit "
                                     "breaker is open on that side (every lookup a fast miss, nothing saved).",
                                     labelnames=labelnames + ["side"], multiprocess_mode="mostrecent")
        self._opened = self._counter_cls(name="vllm:kvstore_breaker_opened", documentation="Times kvstore's "
                                         "breaker opened (the daemon missed deadlines repeatedly).",
                                         labelnames=labelnames + ["side"])
        self._misses = self._counter_cls(name="vllm:kvstore_misses", documentation="Calls into kvstore that gave "
                                         "nothing, by operation (lookup, load, save) and reason (deadline, "
                                         "breaker_open, daemon_gone, no_room, queue_full).",
                                         labelnames=labelnames + ["op", "reason"])
        self._blocks = self._counter_cls(name="vllm:kvstore_missed_blocks", documentation="Blocks not loaded "
                                         "(recomputed) or not saved, by operation and reason.",
                                         labelnames=labelnames + ["op", "reason"])
        self._decisions = self._counter_cls(name="vllm:kvstore_load_decisions", documentation="Cached prefixes "
                                            "loaded (load) or left to vLLM to compute (recompute: expected to arrive "
                                            "later than vLLM computes them).", labelnames=labelnames + ["decision"])
        self._bandwidth = self._gauge_cls(name="vllm:kvstore_load_bandwidth_bytes_per_second", documentation=
                                          "kvstore's load bandwidth as measured (an input of the load decisions).",
                                          labelnames=labelnames, multiprocess_mode="mostrecent")
        self._latency = self._gauge_cls(name="vllm:kvstore_load_latency_seconds", documentation="kvstore's "
                                        "per-load latency as measured (an input of the load decisions).",
                                        labelnames=labelnames, multiprocess_mode="mostrecent")
        self._steps = self._counter_cls(name="vllm:kvstore_load_step_seconds", documentation="Seconds kvstore's "
                                        "loads spent per step: probe (asking what kvstore holds), read (out of "
                                        "kvstore's tiers), write (into vLLM's KV cache).",
                                        labelnames=labelnames + ["step"])
        self._prefill = self._gauge_cls(name="vllm:kvstore_prefill_tokens_per_second", documentation="vLLM's "
                                        "prefill rate as kvstore measured it (an input of the load decisions).",
                                        labelnames=labelnames, multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, (calls, blocks) in transfer_stats_data.get("misses", {}).items():
            op, reason = key.split("|", 1)
            self._misses.labels(*labels, op, reason).inc(calls)
            self._blocks.labels(*labels, op, reason).inc(blocks)
        for side, (is_open, opened) in transfer_stats_data.get("breakers", {}).items():
            self._open.labels(*labels, side).set(is_open)
            self._opened.labels(*labels, side).inc(opened)
        for decision, n in transfer_stats_data.get("decisions", {}).items():
            self._decisions.labels(*labels, decision).inc(n)
        for step, seconds in transfer_stats_data.get("steps", {}).items():
            self._steps.labels(*labels, step).inc(seconds)
        if transfer_stats_data.get("clock"):
            self._bandwidth.labels(*labels).set(transfer_stats_data["clock"][0])
            self._latency.labels(*labels).set(transfer_stats_data["clock"][1])
        if transfer_stats_data.get("prefill"):
            self._prefill.labels(*labels).set(transfer_stats_data["prefill"])
