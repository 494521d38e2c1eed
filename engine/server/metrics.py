"""``kvstore engine serve``'s ``/metrics``: the server's snapshot (``/stats``) as Prometheus families.

Names share the daemon's ``kvstore_`` prefix, ``kvstore_engine_`` for what only an engine knows. The
prefix-cache hit rate is ``kvstore_engine_cached_tokens_total / kvstore_engine_prompt_tokens_total``
(prompt tokens served from the cache, whatever tier they came from), the GPU occupancy
``kvstore_engine_gpu_blocks{state="in_use"} / kvstore_engine_gpu_blocks{state="total"}``.
"""

from __future__ import annotations

from typing import Any

from kvstore.util.prometheus import Family, family

_TOTALS = {
    "requests": "Requests finished.",
    "prompt_tokens": "Prompt tokens of finished requests.",
    "cached_tokens": "Of kvstore_engine_prompt_tokens_total, the tokens served from the prefix cache (any tier).",
    "generated_tokens": "Tokens generated.",
    "refused": "Requests refused (the prompt does not fit the model or the KV cache).",
}


def engine_families(snapshot: dict[str, Any]) -> list[Family]:
    """Families of an :meth:`~engine.server.app.EngineServer.snapshot` (its ``events`` section too)."""
    replica = str(snapshot["replica"])
    out = [
        family("kvstore_engine_in_flight_requests", "gauge", "Requests queued or running.",
               snapshot["in_flight_requests"], replica=replica),
        family("kvstore_engine_in_flight_tokens", "gauge", "Tokens of the requests queued or running.",
               snapshot["in_flight_tokens"], replica=replica),
    ]
    out += [family(f"kvstore_engine_{name}_total", "counter", text, snapshot["totals"].get(name, 0), replica=replica)
            for name, text in _TOTALS.items()]
    blocks = snapshot["gpu_blocks"]
    out.append(Family("kvstore_engine_gpu_blocks", "gauge",
                      "GPU KV blocks: in_use = not free (running requests and cached prefixes), total.")
               .add(blocks["used"], replica=replica, state="in_use").add(blocks["total"], replica=replica, state="total"))
    daemon = snapshot.get("daemon")
    if daemon:  # a sidecar connector: its breaker and what the daemon's misses cost
        out.append(family("kvstore_engine_breaker_open", "gauge", "1 while the breaker toward the daemon is open "
                          "(every lookup a fast miss, nothing saved).", int(daemon["state"] == "open"), replica=replica))
        out.append(family("kvstore_engine_breaker_opened_total", "counter", "Times the breaker toward the daemon "
                          "opened (it missed its deadlines repeatedly).", daemon.get("opened", 0), replica=replica))
        misses = Family("kvstore_engine_misses_total", "counter", "Calls into the daemon that gave nothing, by "
                        "operation (lookup, load, save) and reason (deadline, breaker_open, daemon_gone, no_room).")
        blocks = Family("kvstore_engine_missed_blocks_total", "counter", "Blocks not loaded (recomputed) or not "
                        "saved, by operation and reason.")
        for row in daemon.get("misses", []):
            misses.add(row["calls"], replica=replica, op=row["op"], reason=row["reason"])
            blocks.add(row["blocks"], replica=replica, op=row["op"], reason=row["reason"])
        out += [misses, blocks]
    events = snapshot.get("events") or {}
    if events.get("enabled"):
        out += [
            family("kvstore_events_last_seq", "gauge", "Sequence number of the last KV event batch published "
                   "(-1: none yet).", events["last_seq"], replica=replica),
            family("kvstore_events_replays_served_total", "counter", "Replays of missed batches served to routers.",
                   events["replays_served"], replica=replica),
            family("kvstore_events_reports_served_total", "counter", "Full holdings reports served to routers.",
                   events["reports_served"], replica=replica),
        ]
    return out
