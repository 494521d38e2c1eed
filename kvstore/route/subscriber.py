"""The router's side: follow every replica's KV events into a :class:`RouterIndex`, recovering from loss.

Per replica the subscriber expects seq ``last + 1``:

- a gap (``seq > last + 1``) asks the replica's replay endpoint for the batches from ``last + 1``;
  if they are no longer buffered (the first one replayed is later than asked) or no answer comes
  within ``replay_timeout_s``, it asks for a full report (every block the replica holds, as of some
  seq) and continues after that seq;
- the first batch seen from a replica (the subscriber joined late) is treated as a gap from -1;
- ``seq < last + 1`` is a restart when it is batch 0 starting with ``AllBlocksCleared`` (applied:
  the replica's entries are cleared); otherwise it is counted and logged and the replica is asked
  for a full report, since its history no longer matches ours;
- a replica that answers a report with nothing (vLLM has no reports) is cleared and followed from
  the batch at hand: missing entries cost a hit, stale ones would send requests to the wrong place.

A shared store's feed (a sidecar daemon, :class:`StoreEndpoints`) is followed and recovered the same
way; only the index treats its blocks differently (they count for the replicas it serves).

Bad input (wrong frame count, malformed msgpack, wrong types, unknown event tag or medium) is
counted per replica and logged with the replica and what was wrong; it never stops the thread.
All sockets live on the subscriber's thread; the index is changed under :attr:`EventSubscriber.lock`,
which the front also takes to query it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvstore.util.ratelog import RateLimitedLog
from kvstore.route.index import RouterIndex
from kvstore.route.kv_events import AllBlocksCleared, EventFormatError, KVEventBatch, decode_batch
from kvstore.route.publisher import END_SEQ, REPORT_REQUEST

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaEndpoints:
    """Where one replica publishes: its PUB address and, when it has one, its replay address."""

    events: str
    replay: str | None = None


@dataclass(frozen=True)
class StoreEndpoints(ReplicaEndpoints):
    """A shared store's feed (a sidecar daemon): its endpoints and the replicas it serves (``None``: all)."""

    serves: tuple[str, ...] | None = None


@dataclass
class ReplicaFeed:
    """What the subscriber knows of one replica's stream (counters only grow)."""

    last_seq: int | None = None
    batches: int = 0
    events: int = 0
    lost_batches: int = 0
    """Batches seen missing in gaps (recovered or not)."""
    gaps: int = 0
    replays: int = 0
    """Gaps recovered by replaying the missed batches."""
    full_reports: int = 0
    reports_unavailable: int = 0
    """Reports asked for and not given (no replay endpoint, no answer, a vLLM replica): the replica was cleared."""
    restarts: int = 0
    backwards: int = 0
    """Batches whose seq went backwards without being a restart."""
    bad: dict[str, int] = field(default_factory=dict)
    """Rejected messages by what was wrong (``frames``, ``format``, ``apply``)."""
    lag_s: float = 0.0
    """Receive time minus publish time (``ts``) of the last batch applied."""
    max_lag_s: float = 0.0


class EventSubscriber:
    """A thread with one SUB socket per replica; detects seq gaps and asks the replica's replay
    endpoint (or its full report) to recover; counts lag and lost events."""

    def __init__(self, index: RouterIndex, replicas: Mapping[str, ReplicaEndpoints], *,
                 stores: Mapping[str, StoreEndpoints] | None = None,
                 lock: threading.Lock | None = None, replay_timeout_s: float = 2.0, topic: str = "",
                 context: zmq.Context | None = None) -> None:
        """Follow ``replicas`` and ``stores`` (shared stores whose blocks count for the replicas they serve;
        :meth:`RouterIndex.add_store`). Raises ``ValueError`` when a store shares a replica's name or serves
        a replica not in ``replicas``."""
        self.index = index
        self.lock = lock or threading.Lock()
        """Held while the index changes; take it to query the index from another thread."""
        for name, ep in (stores or {}).items():
            if name in replicas:
                raise ValueError(f"store {name!r} has the name of a replica; give it a name of its own")
            unknown = sorted(set(ep.serves or ()) - set(replicas) - set(index.replicas()))
            if unknown:
                raise ValueError(f"store {name!r} serves {', '.join(unknown)}, which "
                                 f"{'is not a replica' if len(unknown) == 1 else 'are not replicas'}")
        self.replicas: dict[str, ReplicaEndpoints] = {**replicas, **(stores or {})}
        """Every feed followed, replicas' and stores' (by sender name)."""
        self.feeds = {name: ReplicaFeed() for name in self.replicas}
        self._timeout_ms = int(replay_timeout_s * 1000)
        self._topic = topic.encode()
        self._ctx = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-subscriber", daemon=True)
        self._ready = threading.Event()
        self._log = RateLimitedLog(log, 5.0)
        self._started_at = 0.0
        self._connect_error: str | None = None
        with self.lock:
            for name, feed in self.replicas.items():
                if isinstance(feed, StoreEndpoints):
                    index.add_store(name, feed.serves)
                else:
                    index.add_replica(name)

    def start(self) -> None:
        """Connect to every replica on the thread; returns once the sockets are connected.

        Raises ``ValueError`` naming the replica whose address ZMQ refused (the thread is then stopped).
        """
        self._started_at = time.monotonic()
        self._thread.start()
        self._ready.wait()
        if self._connect_error is not None:
            self._thread.join()
            raise ValueError(self._connect_error)

    def close(self) -> None:
        """Stop the thread and close its sockets. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def stats(self) -> dict[str, Any]:
        """Per replica counters and lag, and the totals (events applied, ingest rate since start)."""
        per = {name: {**vars(f), "bad": dict(f.bad)} for name, f in self.feeds.items()}
        events = sum(f.events for f in self.feeds.values())
        elapsed = time.monotonic() - self._started_at if self._started_at else 0.0
        return {
            "replicas": per,
            "events": events,
            "lost_batches": sum(f.lost_batches for f in self.feeds.values()),
            "max_lag_s": max((f.max_lag_s for f in self.feeds.values()), default=0.0),
            "events_per_s": events / elapsed if elapsed > 0 else 0.0,
        }

    # ------------------------------------------------------------ thread
    def _run(self) -> None:
        poller = zmq.Poller()
        subs: dict[zmq.Socket, str] = {}
        try:
            for name, ep in self.replicas.items():
                sock = self._ctx.socket(zmq.SUB)
                subs[sock] = name
                sock.setsockopt(zmq.SUBSCRIBE, self._topic)
                try:
                    sock.connect(ep.events)
                except zmq.ZMQError as exc:
                    self._connect_error = f"replica {name}: cannot connect to its events at {ep.events!r}: {exc}"
                    return
                poller.register(sock, zmq.POLLIN)
            self._ready.set()
            while not self._stop.is_set():
                for sock, _ in poller.poll(50):
                    name = subs[sock]
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(name, frames)
        finally:
            self._ready.set()
            for sock in subs:
                sock.close(linger=0)

    def _on_message(self, name: str, frames: list[bytes]) -> None:
        feed = self.feeds[name]
        if len(frames) != 3 or len(frames[1]) != 8:
            self._reject(name, "frames", f"{len(frames)} frames (want topic, 8-byte seq, payload)")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        try:
            batch = decode_batch(frames[2])
        except EventFormatError as exc:
            self._reject(name, "format", f"batch {seq}: {exc}")
            return
        expected = 0 if feed.last_seq is None else feed.last_seq + 1
        if seq == expected:
            self._apply(name, seq, batch)
        elif seq > expected:
            feed.gaps += 1
            joined = feed.last_seq is None  # a first contact: what came before is not "lost"
            if not joined:
                self._log.warning(f"gap:{name}", "replica %s: batches %d..%d missing; recovering", name, expected,
                                  seq - 1)
            if not self._recover(name, expected) and not joined:
                feed.lost_batches += seq - expected  # not a restart: those batches were really lost
            self._catch_up(name, seq, batch)
        elif seq == 0 and batch.events and isinstance(batch.events[0], AllBlocksCleared):
            feed.restarts += 1
            self._log.warning(f"restart:{name}", "replica %s restarted (batch 0 after %s)", name, feed.last_seq)
            self._apply(name, seq, batch)
        else:
            feed.backwards += 1
            self._log.warning(f"backwards:{name}", "replica %s: batch %d after %s (seq went backwards); asking "
                              "for a full report", name, seq, feed.last_seq)
            self._full_report(name)

    def _catch_up(self, name: str, seq: int, batch: KVEventBatch) -> None:
        """After a recovery, the batch that revealed the gap: apply it unless the recovery covered it."""
        feed = self.feeds[name]
        if feed.last_seq is None or seq == feed.last_seq + 1:
            self._apply(name, seq, batch)

    def _apply(self, name: str, seq: int, batch: KVEventBatch) -> None:
        feed = self.feeds[name]
        try:
            with self.lock:
                self.index.apply(name, batch)
        except EventFormatError as exc:
            self._reject(name, "apply", f"batch {seq}: {exc}")
        else:
            feed.batches += 1
            feed.events += len(batch.events)
            feed.lag_s = max(time.time() - batch.ts, 0.0)
            feed.max_lag_s = max(feed.max_lag_s, feed.lag_s)
        feed.last_seq = seq

    def _reject(self, name: str, what: str, detail: str) -> None:
        feed = self.feeds[name]
        feed.bad[what] = feed.bad.get(what, 0) + 1
        self._log.warning(f"bad:{name}:{what}", "replica %s: rejected a message: %s", name, detail)

    # ---------------------------------------------------------- recovery
    def _recover(self, name: str, start: int) -> bool:
        """Replay from ``start``; fall back to a full report when the replica no longer has it. Returns whether
        the replay began a new history instead (a restart, or a first contact: its seqs are not "lost")."""
        feed = self.feeds[name]
        replies = self._ask(name, start.to_bytes(8, "big", signed=True))
        if replies is not None:
            batches = [(s, b) for s, b in replies if s >= start]
            fresh = bool(batches) and batches[0][0] != start and _starts_history(batches[0][1])
            if fresh:
                # The replica's buffer begins with its first batch (a full report, AllBlocksCleared first)
                # after the seq asked for: it restarted (or we joined late). That batch and the rest are
                # its whole history: apply them instead of asking for a report.
                if feed.last_seq is not None:
                    feed.restarts += 1
                    self._log.warning(f"restart:{name}", "replica %s restarted (its feed now begins at batch %d)",
                                      name, batches[0][0])
                feed.last_seq = batches[0][0] - 1
            if batches and batches[0][0] == (feed.last_seq if feed.last_seq is not None else -1) + 1:
                for s, b in batches:
                    if s == (feed.last_seq if feed.last_seq is not None else -1) + 1:
                        self._apply(name, s, b)
                feed.replays += 1
                return fresh
        self._full_report(name)
        return False

    def _full_report(self, name: str) -> None:
        """Replace what the index holds for ``name`` with its full report (cleared when it gives none)."""
        feed = self.feeds[name]
        replies = self._ask(name, REPORT_REQUEST)
        if replies:
            seq, report = replies[0]
            with self.lock:
                self.index.clear(name)
            self._apply(name, seq, report)
            feed.full_reports += 1
            if seq < 0:
                feed.last_seq = -1
            return
        feed.reports_unavailable += 1
        self._log.warning(f"noreport:{name}", "replica %s gave no full report; forgetting what it held", name)
        with self.lock:
            self.index.clear(name)
        feed.last_seq = None  # the next batch is taken as it comes

    def _ask(self, name: str, request: bytes) -> list[tuple[int, KVEventBatch]] | None:
        """Send one replay request; the batches answered, in order (``None``: no endpoint or no answer)."""
        endpoint = self.replicas[name].replay
        if endpoint is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
            sock.send_multipart((b"", request))
            out: list[tuple[int, KVEventBatch]] = []
            while True:
                if not sock.poll(self._timeout_ms):
                    self._log.warning(f"replay-timeout:{name}", "replica %s: no replay answer in %d ms", name,
                                      self._timeout_ms)
                    return None
                frames = sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self._reject(name, "frames", f"replay answer of {len(frames)} frames")
                    return None
                if frames[2] == END_SEQ and frames[3] == b"":
                    return out
                try:
                    out.append((int.from_bytes(frames[2], "big", signed=True), decode_batch(frames[3])))
                except EventFormatError as exc:
                    self._reject(name, "format", f"replayed batch: {exc}")
                    return None
        finally:
            sock.close(linger=0)


def _starts_history(batch: KVEventBatch) -> bool:
    """Whether ``batch`` begins with ``AllBlocksCleared`` (a replica's first batch, or a reset)."""
    return bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
