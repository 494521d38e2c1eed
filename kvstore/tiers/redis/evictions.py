"""Learn of Redis's own evictions from keyspace notifications (``__keyevent@<db>__:evicted``).

Redis publishes an event per evicted key when ``notify-keyspace-events`` holds ``E`` (key-event
channel) and ``e`` (evicted; ``A`` includes it). A cluster does not forward notifications between
nodes, so one listener per node is subscribed (replicas too: after a failover the promoted replica
is the one that evicts). A node without the setting, or a lost connection, is not fatal: the tier
then learns of an eviction when a read misses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

log = logging.getLogger("kvstore.tiers.redis.tier")

EVICTED_PATTERN = "__keyevent@*__:evicted"


def notifications_enabled(flags: str) -> bool:
    """Whether a ``notify-keyspace-events`` value publishes evictions on the key-event channel."""
    return "E" in flags and ("e" in flags or "A" in flags)


class EvictionListener:
    """Background threads, one per node, calling ``on_evicted(redis_key)`` per eviction event.

    ``connect(host, port)`` makes a plain client of one node. Stopped by :meth:`close`.
    """

    def __init__(self, nodes: list[tuple[str, int]], connect: Callable[[str, int], redis.Redis],
                 on_evicted: Callable[[bytes], None], retry_s: float = 0.5) -> None:
        self._connect = connect
        self._on_evicted = on_evicted
        self._retry_s = retry_s
        self._stop = threading.Event()
        self.subscribed: set[tuple[str, int]] = set()
        """Nodes whose subscription is live now."""
        self.disabled: set[tuple[str, int]] = set()
        """Nodes whose ``notify-keyspace-events`` does not publish evictions."""
        self._threads = [
            threading.Thread(target=self._run, args=(node,), name=f"kvstore-evictions-{node[0]}:{node[1]}", daemon=True)
            for node in nodes
        ]
        for t in self._threads:
            t.start()

    def wait_subscribed(self, timeout: float) -> bool:
        """Wait until every node is subscribed or disabled; returns whether that happened in time."""
        deadline = threading.Event()
        for _ in range(int(timeout / 0.01) + 1):
            if len(self.subscribed) + len(self.disabled) >= len(self._threads):
                return True
            deadline.wait(0.01)
        return False

    def _run(self, node: tuple[str, int]) -> None:
        while not self._stop.is_set():
            client: redis.Redis | None = None
            try:
                client = self._connect(*node)
                flags = client.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
                flags = flags.decode() if isinstance(flags, bytes) else str(flags)
                if not notifications_enabled(flags):
                    if node not in self.disabled:
                        log.info("remote node %s:%d has notify-keyspace-events=%r (no 'E' + 'e'): evictions are "
                                 "learnt from failed reads", node[0], node[1], flags)
                    self.disabled.add(node)
                    self._stop.wait(30.0)  # look again later: an operator may enable it
                    continue
                self.disabled.discard(node)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.psubscribe(EVICTED_PATTERN)
                self.subscribed.add(node)
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.2)
                    if msg is not None and msg.get("type") == "pmessage":
                        data = msg["data"]
                        self._on_evicted(data if isinstance(data, bytes) else str(data).encode())
                pubsub.close()
            except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
                self.subscribed.discard(node)
                log.debug("eviction listener on %s:%d: %s; retrying", node[0], node[1], exc)
                self._stop.wait(self._retry_s)
            finally:
                self.subscribed.discard(node)
                if client is not None:
                    client.close()

    def close(self) -> None:
        """Stop every listener thread and wait for them."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2.0)
