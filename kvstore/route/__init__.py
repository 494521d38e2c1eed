"""KV-cache-aware routing: send each request to the replica that already holds its prefix.

- :mod:`kvstore.route.kv_events`: block stored / removed / all-cleared events in vLLM's msgpack shape.
- :mod:`kvstore.route.publisher`: a replica publishes its store's events over ZMQ, with replay and a full report.
- :mod:`kvstore.route.subscriber`: the router follows every replica, recovering from lost events.
- :mod:`kvstore.route.index`: block key -> {replica: tiers}, what each replica holds.
- :mod:`kvstore.route.policy`: the cost of sending a prompt to each replica; the cheapest wins.
"""
