"""``kvstore route``'s ``/metrics``: the router's snapshot (``/stats``) as Prometheus families.

The routed hit rate is ``kvstore_route_hit_blocks_total / kvstore_route_prompt_blocks_total``;
each replica's share ``kvstore_route_replica_decisions_total{replica} / kvstore_route_decisions_total``.
"""

from __future__ import annotations

from typing import Any

from kvstore.util.prometheus import Family, family


def route_families(snapshot: dict[str, Any]) -> list[Family]:
    """Families of a :meth:`~kvstore.route.proxy.Router.snapshot` (its ``events`` section too)."""
    s = snapshot
    out = [
        family("kvstore_route_decisions_total", "counter", "Requests routed.", s["decisions"]),
        family("kvstore_route_retries_total", "counter", "Requests sent again to the next choice after a replica "
               "refused or failed before answering.", s["retries"]),
        family("kvstore_route_failed_total", "counter", "Requests no replica answered.", s["failed"]),
        family("kvstore_route_prompt_blocks_total", "counter", "Prompt blocks of the routed requests, in the "
               "chosen replica's blocks.", s["prompt_blocks"]),
        family("kvstore_route_hit_blocks_total", "counter", "Of kvstore_route_prompt_blocks_total, the blocks the "
               "router's index found cached on the chosen replica.", s["hit_blocks"]),
        Family("kvstore_route_decisions_by_hit_blocks_total", "counter", "Requests routed, by how many prompt "
               "blocks the chosen replica held.",
               [({"hit_blocks": bucket}, n) for bucket, n in sorted(s["hit_blocks_histogram"].items())]),
        family("kvstore_route_decision_seconds_total", "counter", "Seconds spent choosing replicas (mean: divide "
               "by kvstore_route_decisions_total).", s["decision_seconds_total"]),
        family("kvstore_route_decision_seconds_max", "gauge", "Longest single decision, seconds.",
               s["decision_seconds"]["max"]),
    ]
    up = Family("kvstore_route_replica_up", "gauge", "1 while the replica answers its health checks.")
    chosen = Family("kvstore_route_replica_decisions_total", "counter", "Requests routed to the replica.")
    requests = Family("kvstore_route_replica_in_flight_requests", "gauge", "Requests in flight on the replica: "
                      "source=router counts what the router sent, source=reported what the replica's metrics say.")
    tokens = Family("kvstore_route_replica_in_flight_tokens", "gauge", "Tokens in flight on the replica (sources as "
                    "for requests; a vLLM replica reports none).")
    for name, r in sorted(s["replicas"].items()):
        up.add(1 if r["up"] else 0, replica=name, url=r["url"])
        chosen.add(r["decisions"], replica=name)
        requests.add(r["in_flight_requests"], replica=name, source="router")
        requests.add(r["reported_in_flight_requests"], replica=name, source="reported")
        tokens.add(r["in_flight_tokens"], replica=name, source="router")
        tokens.add(r["reported_in_flight_tokens"], replica=name, source="reported")
    out += [up, chosen, requests, tokens]
    events = s.get("events")
    if events is not None:
        out += [
            family("kvstore_route_events_total", "counter", "KV events applied to the router's index.",
                   events["events"]),
            family("kvstore_route_events_lost_batches_total", "counter", "Event batches seen missing in gaps "
                   "(recovered by replay or not).", events["lost_batches"]),
            family("kvstore_route_events_max_lag_seconds", "gauge", "Longest receive minus publish time of an "
                   "applied batch.", events["max_lag_s"]),
        ]
        feeds = events["replicas"]
        per = {"events": ("kvstore_route_replica_events_total", "KV events applied from the replica."),
               "lost_batches": ("kvstore_route_replica_lost_batches_total", "Batches of the replica seen missing."),
               "replays": ("kvstore_route_replica_replays_total", "Gaps recovered by replaying the missed batches."),
               "restarts": ("kvstore_route_replica_restarts_total", "Times the replica's stream started over.")}
        for key, (name, text) in per.items():
            f = Family(name, "counter", text)
            for replica, feed in sorted(feeds.items()):
                f.add(feed[key], replica=replica)
            out.append(f)
        bad = Family("kvstore_route_replica_bad_messages_total", "counter",
                     "Event messages rejected, by what was wrong with them.")
        for replica, feed in sorted(feeds.items()):
            for what, n in sorted(feed["bad"].items()):
                bad.add(n, replica=replica, reason=what)
        out.append(bad)
    return out
