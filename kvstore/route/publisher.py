"""A replica's side: publish KV event batches over ZMQ, replay missed ones, report everything held.

Wire format (vLLM's ``ZmqEventPublisher``, so vLLM's subscribers read kvstore and the router reads vLLM):

- PUB: multipart ``[topic, seq as 8-byte big-endian, msgpack KVEventBatch]``, seq 0, 1, 2, ...
- ROUTER (replay): a DEALER sends ``[b"", start seq (8 bytes)]``; the reply is every buffered
  batch from ``start`` as ``[b"", topic, seq, payload]``, then ``[b"", b"", -1 (8 bytes), b""]``.
- Full report (kvstore's addition on the same socket): ``[b"", b"REPORT"]`` is answered with one
  ``[b"", topic, seq, payload]`` whose payload is ``AllBlocksCleared`` then every block held per
  tier, true as of batch ``seq`` (signed; -1 when nothing was published yet), then the end marker.
  Events after ``seq`` may already be in the report; applying them again changes nothing, because
  stored and removed set and clear a tier, so a router that applies the report and then every batch
  after ``seq`` ends up where the replica is.

The PUB socket is used under a lock by whichever thread publishes; the ROUTER socket only by the
replay thread.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import zmq

from kvstore.events import StoreEvent
from kvstore.route.kv_events import AllBlocksCleared, KVEvent, encode_batch
from kvstore.route.translate import batch_of, kv_events, report_events, store_holdings

if TYPE_CHECKING:
    from kvstore.config.events import EventsConfig
    from kvstore.store.tiered import TieredStore

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame of the end-of-replay marker (vLLM's)."""
REPORT_REQUEST = b"REPORT"
"""The replay request frame that asks for a full report instead of a range of batches."""

Report = Callable[[], list[KVEvent]]
"""Returns a full report's events (``AllBlocksCleared`` first); called on the replay thread."""


class EventPublisher:
    """ZMQ PUB of KV event batches, plus a ROUTER replay endpoint serving batches from a ring buffer
    by seq and a full report (every block held, per tier) for a router that fell too far behind."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, replica: str, *, block_size: int = 16,
                 topic: str = "", buffer_batches: int = 10_000, report: Report | None = None,
                 hwm: int = 100_000, context: zmq.Context | None = None, first_seq: int = 0,
                 report_interval_s: float = 1.0) -> None:
        """Bind ``endpoint`` (and ``replay_endpoint``); port 0 picks a free port (see :attr:`endpoint`).

        ``report``: how to build a full report; without one, a report request gets only the end marker.
        ``report_interval_s``: a report is built at most once per this many seconds; requests in between get
        the last one, as of its seq (the router replays the batches after it from the buffer), so a flood of
        report requests, which list every key held, costs one report per interval. ``0``: build each time.
        ``first_seq``: the seq of the first batch (vLLM's publisher starts at 0; :func:`publish_feed` starts
        each process at :func:`start_seq`, so a restart's seqs never repeat the previous run's).
        """
        self.replica = replica
        self.block_size = block_size
        self._topic = topic.encode()
        self._report = report
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_seq = first_seq
        self._sent_at = time.monotonic()
        self._heartbeat_s: float | None = None
        self.replays_served = 0
        """Replay requests answered (counted on the replay thread)."""
        self.reports_served = 0
        self.reports_built = 0
        """Full reports built (at most one per ``report_interval_s``; the rest of :attr:`reports_served` reused one)."""
        self.report_interval_s = report_interval_s
        self._last_report: tuple[float, int, bytes] | None = None  # (built at, seq, payload); replay thread only
        """Full-report requests answered."""
        self._closed = threading.Event()
        self._stop_follow = threading.Event()
        self._follower: threading.Thread | None = None
        self._drain: Callable[[], list[StoreEvent]] | None = None
        # XPUB, not PUB: the same frames reach SUB sockets, and subscriptions become visible
        # (:meth:`wait_for_subscribers`), so a start can wait for the router instead of guessing.
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only a topic's first
        self._subscribers = 0
        self.endpoint = _bind(self._pub, endpoint)
        """The bound PUB address (port 0 resolved)."""
        self.replay_endpoint: str | None = None
        """The bound replay address, or ``None``."""
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_batches + 2))
            try:
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
            except OSError:
                self._replay.close(linger=0)
                self._pub.close(linger=0)
                raise
            self._thread = threading.Thread(target=self._serve_replay, name=f"kv-events-replay-{replica}",
                                            daemon=True)
            self._thread.start()

    @property
    def last_seq(self) -> int:
        """Seq of the last published batch (-1 before the first)."""
        with self._lock:
            return self._next_seq - 1

    def publish(self, events: Sequence[StoreEvent]) -> int:
        """Publish the store's ``events`` (oldest first) as one batch; returns its seq (-1: nothing to send)."""
        if not events:
            return -1
        return self.publish_kv(kv_events(events, self.block_size))

    def publish_kv(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Publish KV events as one batch stamped ``ts`` (default now); returns its seq."""
        payload = encode_batch(batch_of(events, ts))
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError(f"event publisher of replica {self.replica} is closed")
            seq = self._next_seq
            self._next_seq += 1
            self._send((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self._sent_at = time.monotonic()
        return seq

    @property
    def idle_s(self) -> float:
        """Seconds since the last batch was published."""
        with self._lock:
            return time.monotonic() - self._sent_at

    def _send(self, frames: tuple[bytes, bytes, bytes]) -> None:
        """Put one batch on the wire (called under the lock; the one place a batch is sent)."""
        self._pub.send_multipart(frames)

    def wait_for_subscribers(self, n: int = 1, timeout_s: float = 5.0) -> bool:
        """Wait until ``n`` subscriptions have reached this publisher (a router connected); ``False`` on timeout.

        Batches published before a router subscribed never reach it (ZMQ drops them); it then recovers
        them by replay, so this wait is an optimisation for starts and tests, never needed for correctness.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._subscribers < n:
                left = deadline - time.monotonic()
                if left <= 0 or not self._pub.poll(int(left * 1000)):
                    return False
                msg = self._pub.recv()
                if msg[:1] == b"\x01":
                    self._subscribers += 1
                elif msg[:1] == b"\x00":
                    self._subscribers -= 1
        return True

    def publish_cleared(self) -> int:
        """Publish ``AllBlocksCleared`` (a start or a reset: the router forgets what this replica held)."""
        return self.publish_kv([AllBlocksCleared()])

    def follow(self, drain: Callable[[], list[StoreEvent]], interval_s: float, heartbeat_s: float | None = None) -> None:
        """Every ``interval_s``, on a thread, publish what ``drain`` returns (a store's ``drain_events``);
        :meth:`close` publishes what is left and stops it. Once per publisher.

        ``heartbeat_s``: after that long with nothing to publish, publish an empty batch. Its seq tells a
        router that missed batches, or a whole restart (batch 0 lost while its SUB socket reconnected),
        that it is behind, so it recovers without waiting for the replica's next real event."""
        if self._follower is not None:
            raise RuntimeError(f"event publisher of replica {self.replica} already follows a store")
        self._drain = drain
        self._heartbeat_s = heartbeat_s
        self._follower = threading.Thread(target=self._follow, args=(interval_s,),
                                          name=f"kv-events-{self.replica}", daemon=True)
        self._follower.start()

    def pump(self) -> int:
        """Publish what the followed store queued since the last call now; returns the seq (-1: nothing)."""
        if self._drain is None:
            return -1
        return self.publish(self._drain())

    def _follow(self, interval_s: float) -> None:
        while not self._stop_follow.wait(interval_s):
            try:
                if self.pump() < 0 and self._heartbeat_s is not None and self.idle_s >= self._heartbeat_s:
                    self.publish_kv([])
            except Exception:  # noqa: BLE001 - the thread must outlive one failure; logged with its cause
                log.exception("replica %s: publishing KV events failed", self.replica)

    def close(self) -> None:
        """Publish what the followed store still queued, stop the threads, close both sockets. Idempotent."""
        if self._follower is not None and not self._stop_follow.is_set():
            self._stop_follow.set()
            self._follower.join()
            self.pump()
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        if self._thread is not None:
            self._thread.join()
        self._pub.close(linger=0)

    # ------------------------------------------------------------ replay
    def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        try:
            while not self._closed.is_set():
                if not sock.poll(50):
                    continue
                frames = sock.recv_multipart()
                try:
                    self._answer(sock, frames)
                except zmq.ZMQError as exc:  # a peer gone mid-answer must not stop the endpoint
                    log.warning("replica %s: replay answer failed: %s", self.replica, exc)
        finally:
            sock.close(linger=0)

    def _answer(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"":
            log.warning("replica %s: replay request of %d frames ignored (want [b'', seq or REPORT])",
                        self.replica, len(frames) - 1)
            return
        client, _, request = frames
        if request == REPORT_REQUEST:
            self.reports_served += 1
            if self._report is not None:
                try:
                    seq, payload = self._full_report(self._report)
                except Exception:  # noqa: BLE001 - answer "no report" (the router clears this replica), keep serving
                    log.exception("replica %s: building the full report failed", self.replica)
                else:
                    sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big", signed=True), payload))
        elif len(request) == 8:
            self.replays_served += 1
            start = int.from_bytes(request, "big")
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start]
            for s, p in batches:
                sock.send_multipart((client, b"", self._topic, s.to_bytes(8, "big"), p))
        else:
            log.warning("replica %s: replay request %r is neither an 8-byte seq nor REPORT", self.replica,
                        request[:16])
        sock.send_multipart((client, b"", b"", END_SEQ, b""))


    def _full_report(self, report: Report) -> tuple[int, bytes]:
        """The seq and encoded batch of a full report: the last one built if it is younger than
        ``report_interval_s`` and every batch after its seq is still in the buffer, else a new one."""
        now, last = time.monotonic(), self._last_report
        if last is not None and now - last[0] < self.report_interval_s:
            with self._lock:
                replayable = not self._buffer or self._buffer[0][0] <= last[1] + 1
            if replayable:
                return last[1], last[2]
        seq = self.last_seq  # read before the snapshot: the report holds at least batches <= seq
        payload = encode_batch(batch_of(report()))
        self.reports_built += 1
        self._last_report = (now, seq, payload)
        return seq, payload


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint``; returns the address bound (a tcp port 0 resolved)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(f"cannot bind KV events socket to {endpoint}: {exc}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def start_seq() -> int:
    """The first seq of a process's feed: microseconds since the epoch. Each later batch adds one, so a
    restarted replica's seqs are above the previous run's (unless that run sent over a million batches a
    second), and a router that missed the restart sees a gap: the replay it asks for then begins at the
    new run's first batch, a full report (``AllBlocksCleared`` first), which replaces what it knew."""
    return time.time_ns() // 1000


def default_replica_id() -> str:
    """``<hostname>:<pid>``: the replica id when the config names none."""
    return f"{socket.gethostname()}:{os.getpid()}"


def attach_publisher(store: TieredStore, cfg: EventsConfig) -> EventPublisher:
    """Publish ``store``'s events as ``cfg`` says, drained on a thread every ``cfg.interval_s``.

    The first batch is a full report, ``AllBlocksCleared`` first (a start: what a router knew of this
    replica is gone), then what the store's index holds (gpu, host, disk; nothing for a new store). Close
    the publisher before the store.
    """
    return publish_feed(cfg, store.layout.block_size, store.drain_events, lambda: store_holdings(store))


def publish_feed(cfg: EventsConfig, block_size: int, drain: Callable[[], list[StoreEvent]],
                 holdings: Callable[[], dict[str, list[bytes]]], default_id: str | None = None) -> EventPublisher:
    """A publisher bound as ``cfg`` says whose batch 0 is a full report (``AllBlocksCleared``, then every
    block ``holdings()`` lists: what a restarted daemon still has on disk), then publishes what ``drain``
    returns every ``cfg.interval_s``; a full-report request is answered from ``holdings()`` too. The
    replica id is ``cfg.replica_id``, else ``default_id``, else :func:`default_replica_id`."""
    publisher = EventPublisher(cfg.endpoint, cfg.replay_endpoint, cfg.replica_id or default_id or default_replica_id(),
                               block_size=block_size, topic=cfg.topic, buffer_batches=cfg.buffer_batches,
                               report=lambda: report_events(holdings(), block_size), first_seq=start_seq(),
                               report_interval_s=cfg.report_interval_s)
    loopback = all(_on_loopback(e) for e in (publisher.endpoint, publisher.replay_endpoint) if e)
    (log.info if loopback else log.warning)(
        "KV events on %s (replay %s) are unauthenticated: any process that can reach them reads every block key "
        "and tier%s", publisher.endpoint, publisher.replay_endpoint or "off",
        "" if loopback else "; this endpoint is not loopback-only, keep it on a private network")
    drain()  # what the holdings below already include
    publisher.publish_kv(report_events(holdings(), block_size))
    publisher.follow(drain, cfg.interval_s, cfg.heartbeat_s)
    return publisher


def _on_loopback(endpoint: str) -> bool:
    """Whether a bound ZMQ endpoint is reachable from this machine only (ipc, inproc, or a loopback address)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")

