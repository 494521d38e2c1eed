"""Publisher and subscriber over real ZMQ on loopback: order, loss and replay, report, restart, bad input."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from kvstore.events import StoreEvent
from kvstore.route.index import PrefixHit, RouterIndex
from kvstore.route.kv_events import AllBlocksCleared, KVEventBatch, encode_batch
from kvstore.route.publisher import EventPublisher
from kvstore.route.subscriber import EventSubscriber, ReplicaEndpoints, StoreEndpoints
from kvstore.route.translate import report_events

K = [i.to_bytes(32, "big") for i in range(32)]


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``cond`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


class Replica:
    """A fake replica: the set of blocks it holds (for its full report) and its publisher."""

    def __init__(self, name: str, endpoint: str = "tcp://127.0.0.1:0", replay: str | None = "tcp://127.0.0.1:0",
                 buffer_batches: int = 100, drop: set[int] | None = None, first_seq: int = 0) -> None:
        self.held: dict[str, list[bytes]] = {"gpu": []}
        report = lambda: report_events({t: list(k) for t, k in self.held.items()}, 16)  # noqa: E731
        cls = LossyPublisher if drop else EventPublisher
        self.pub = cls(endpoint, replay, name, buffer_batches=buffer_batches, report=report, first_seq=first_seq)
        if drop:
            self.pub.drop = drop  # type: ignore[attr-defined]

    def store(self, *keys: bytes) -> int:
        self.held["gpu"].extend(keys)
        return self.pub.publish([StoreEvent("stored", k, "gpu") for k in keys])

    def endpoints(self) -> ReplicaEndpoints:
        return ReplicaEndpoints(self.pub.endpoint, self.pub.replay_endpoint)


class LossyPublisher(EventPublisher):
    """Loses the batches whose seq is in ``drop`` on the wire (they stay in the replay buffer, as a real loss)."""

    drop: set[int]

    def _send(self, frames: tuple[bytes, bytes, bytes]) -> None:
        if int.from_bytes(frames[1], "big") not in self.drop:
            super()._send(frames)


@pytest.fixture
def follow() -> Iterator[Callable[..., EventSubscriber]]:
    made: list[EventSubscriber] = []

    def make(*replicas: Replica, **kw: object) -> EventSubscriber:
        sub = EventSubscriber(RouterIndex(), {r.pub.replica: r.endpoints() for r in replicas}, **kw)  # type: ignore[arg-type]
        sub.start()
        made.append(sub)
        for r in replicas:
            assert r.pub.wait_for_subscribers(1)
        return sub

    yield make
    for sub in made:
        sub.close()


def _prefix(sub: EventSubscriber, keys: list[bytes]) -> dict[str, PrefixHit]:
    with sub.lock:
        return sub.index.cached_prefix(keys)


def test_batches_arrive_in_order_per_replica(follow: Callable[..., EventSubscriber]) -> None:
    a, b = Replica("a"), Replica("b")
    sub = follow(a, b)
    assert [a.store(K[0]), a.store(K[1], K[2]), b.store(K[0])] == [0, 1, 0]
    wait_until(lambda: sub.feeds["a"].last_seq == 1 and sub.feeds["b"].last_seq == 0)
    assert _prefix(sub, K[:3]) == {"a": PrefixHit(3, {"gpu": 3}), "b": PrefixHit(1, {"gpu": 1})}
    stats = sub.stats()
    assert stats["events"] == 3 and stats["lost_batches"] == 0
    assert stats["replicas"]["a"]["gaps"] == 0 and stats["max_lag_s"] >= 0
    a.pub.close(); b.pub.close()


def test_dropped_batches_are_replayed(follow: Callable[..., EventSubscriber]) -> None:
    a = Replica("a", drop={1, 2})
    sub = follow(a)
    for i in range(4):
        a.store(K[i])
    wait_until(lambda: sub.feeds["a"].last_seq == 3)
    f = sub.feeds["a"]
    assert (f.gaps, f.lost_batches, f.replays, f.full_reports, f.batches) == (1, 2, 1, 0, 4)
    assert a.pub.replays_served == 1
    assert _prefix(sub, K[:4])["a"] == PrefixHit(4, {"gpu": 4})
    a.pub.close()


def test_replay_window_exceeded_falls_back_to_the_full_report(follow: Callable[..., EventSubscriber]) -> None:
    a = Replica("a", buffer_batches=2, drop={1, 2, 3, 4})
    sub = follow(a)
    for i in range(6):
        a.store(K[i])
    wait_until(lambda: sub.feeds["a"].last_seq == 5)
    f = sub.feeds["a"]
    assert (f.gaps, f.lost_batches, f.replays, f.full_reports) == (1, 4, 0, 1)
    assert a.pub.reports_served == 1
    assert _prefix(sub, K[:6])["a"] == PrefixHit(6, {"gpu": 6})
    a.store(K[6])
    wait_until(lambda: sub.feeds["a"].last_seq == 6)
    assert _prefix(sub, K[:7])["a"] == PrefixHit(7, {"gpu": 7})
    a.pub.close()


def test_a_late_subscriber_recovers_what_was_published_before_it(follow: Callable[..., EventSubscriber]) -> None:
    a = Replica("a")
    a.store(K[0]); a.store(K[1])  # nobody listens yet: ZMQ drops these
    sub = follow(a)
    a.store(K[2])
    wait_until(lambda: sub.feeds["a"].last_seq == 2)
    assert sub.feeds["a"].replays == 1
    assert _prefix(sub, K[:3])["a"] == PrefixHit(3, {"gpu": 3})
    a.pub.close()


def _rebind(make: Callable[[], Replica], timeout_s: float = 10.0) -> Replica:
    """``make()`` once the old sockets' ports are free (ZMQ releases a closed socket's port asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return make()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_a_replica_restart_clears_what_it_held(follow: Callable[..., EventSubscriber]) -> None:
    a, b = Replica("a"), Replica("b")
    sub = follow(a, b)
    a.store(K[0], K[1]); b.store(K[0])
    wait_until(lambda: sub.feeds["a"].last_seq == 0 and sub.feeds["b"].last_seq == 0)
    endpoint, replay = a.pub.endpoint, a.pub.replay_endpoint
    a.pub.close()
    a2 = _rebind(lambda: Replica("a", endpoint, replay))  # same addresses, fresh seq and an empty cache
    assert a2.pub.wait_for_subscribers(1)
    assert a2.pub.publish_cleared() == 0
    a2.store(K[5])
    wait_until(lambda: sub.feeds["a"].last_seq == 1 and sub.feeds["a"].restarts == 1)
    assert _prefix(sub, [K[0]]) == {"a": PrefixHit(0, {}), "b": PrefixHit(1, {"gpu": 1})}
    assert _prefix(sub, [K[5]])["a"] == PrefixHit(1, {"gpu": 1})
    a2.pub.close(); b.pub.close()


def test_hostile_messages_are_counted_and_logged_never_fatal(follow: Callable[..., EventSubscriber],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.XPUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    sub = EventSubscriber(RouterIndex(), {"evil": ReplicaEndpoints(f"tcp://127.0.0.1:{port}")})
    sub.start()
    assert raw.poll(5000)
    raw.recv()  # the subscription
    good = encode_batch(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
    stored = msgspec.msgpack.encode([time.time(), [{"type": "BlockStored", "block_hashes": [K[0]],
                                                    "parent_block_hash": None, "token_ids": [], "block_size": 16,
                                                    "lora_id": None, "medium": "GPU", "lora_name": None}]])
    with caplog.at_level(logging.WARNING, logger="kvstore.route.subscriber"):
        raw.send_multipart([b"", (0).to_bytes(8, "big")])                                     # 2 frames
        raw.send_multipart([b"", b"\x00" * 4, good])                                          # short seq
        raw.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1\xc1"])                        # malformed msgpack
        raw.send_multipart([b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode(["x", []])])  # wrong types
        raw.send_multipart([b"", (0).to_bytes(8, "big"),
                            msgspec.msgpack.encode([1.0, [{"type": "Evil"}]])])               # unknown tag
        raw.send_multipart([b"", (0).to_bytes(8, "big"), stored.replace(b"GPU", b"XYZ")])     # unknown medium
        raw.send_multipart([b"", (1).to_bytes(8, "big"), stored])                             # good, seq 1
        raw.send_multipart([b"", (2).to_bytes(8, "big"), good])                               # good, seq 2
        raw.send_multipart([b"", (0).to_bytes(8, "big"), stored])                             # backwards
        wait_until(lambda: sub.feeds["evil"].backwards == 1)
    f = sub.feeds["evil"]
    assert f.bad == {"frames": 2, "format": 3, "apply": 1}
    # seq 0 was the unknown medium (rejected but consumed), so 1 and 2 followed in order
    assert (f.last_seq, f.gaps, f.backwards, f.reports_unavailable) == (None, 0, 1, 1)
    assert sub.index.blocks("evil") == 0  # no replay endpoint: what it said is forgotten, never trusted
    messages = [r.getMessage() for r in caplog.records]
    assert any("replica evil: rejected a message: batch 0: unknown medium 'XYZ'" in m for m in messages)
    assert any("replica evil: batch 0 after 2 (seq went backwards)" in m for m in messages)
    assert sub.stats()["replicas"]["evil"]["bad"]["format"] == 3
    raw.send_multipart([b"", (7).to_bytes(8, "big"), stored])  # followed again from whatever comes next
    wait_until(lambda: sub.feeds["evil"].last_seq == 7)
    assert sub.index.blocks("evil") == 1
    sub.close()
    raw.close(linger=0)


def test_close_publishes_what_a_followed_store_still_queued(follow: Callable[..., EventSubscriber]) -> None:
    a = Replica("a")
    sub = follow(a)
    queued = [StoreEvent("stored", K[0], "gpu")]
    drained = threading.Event()

    def drain() -> list[StoreEvent]:
        out, queued[:] = list(queued), []
        drained.set()
        return out

    a.pub.follow(drain, 3600.0)  # the thread never wakes in this test: close() must pump
    a.pub.close()
    assert drained.is_set()
    wait_until(lambda: sub.feeds["a"].last_seq == 0)
    assert _prefix(sub, [K[0]])["a"] == PrefixHit(1, {"gpu": 1})


def test_a_failing_report_is_answered_with_nothing_and_the_endpoint_keeps_serving(
        follow: Callable[..., EventSubscriber]) -> None:
    def broken() -> list:
        raise RuntimeError("index unavailable")

    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "a", buffer_batches=1, report=broken)
    a = Replica.__new__(Replica)
    a.held, a.pub = {"gpu": []}, pub
    pub.publish([StoreEvent("stored", K[0], "gpu")])  # before the router: lost, and out of the buffer below
    pub.publish([StoreEvent("stored", K[1], "gpu")])
    sub = follow(a)
    pub.publish([StoreEvent("stored", K[2], "gpu")])
    wait_until(lambda: sub.feeds["a"].last_seq == 2)
    f = sub.feeds["a"]
    assert (f.full_reports, f.reports_unavailable, pub.reports_served) == (0, 1, 1)
    assert _prefix(sub, [K[2]])["a"] == PrefixHit(1, {"gpu": 1})  # followed from the batch at hand
    dealer = zmq.Context.instance().socket(zmq.DEALER)  # the replay endpoint still answers
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (2).to_bytes(8, "big")])
    assert dealer.poll(5000)
    assert dealer.recv_multipart()[2] == (2).to_bytes(8, "big")
    dealer.close(linger=0)
    pub.close()


def test_an_address_zmq_refuses_is_an_error_naming_the_replica() -> None:
    sub = EventSubscriber(RouterIndex(), {"ok": ReplicaEndpoints("tcp://127.0.0.1:5999"),
                                          "bad": ReplicaEndpoints("tcp://no port here")})
    with pytest.raises(ValueError, match="replica bad: cannot connect to its events at 'tcp://no port here'"):
        sub.start()
    sub.close()


def test_a_store_that_clashes_with_a_replica_or_serves_an_unknown_one_is_refused() -> None:
    replicas = {"a": ReplicaEndpoints("tcp://127.0.0.1:1")}
    with pytest.raises(ValueError, match="store 'a' has the name of a replica"):
        EventSubscriber(RouterIndex(), replicas, stores={"a": StoreEndpoints("tcp://127.0.0.1:2")})
    with pytest.raises(ValueError, match="store 'd' serves b, c, which are not replicas"):
        EventSubscriber(RouterIndex(), replicas, stores={"d": StoreEndpoints("tcp://127.0.0.1:2", serves=("a", "b", "c"))})
    index = RouterIndex()
    EventSubscriber(index, replicas, stores={"d": StoreEndpoints("tcp://127.0.0.1:2", serves=("a",))})
    assert index.replicas() == ["a"] and index.stores() == ["d"]


def test_an_idle_publisher_sends_heartbeats_and_a_missed_restart_is_found_by_their_seq(
        follow: Callable[..., EventSubscriber]) -> None:
    a = Replica("a", first_seq=1000)
    sub = follow(a)
    a.store(K[0], K[1], K[2])
    wait_until(lambda: sub.feeds["a"].last_seq == 1000)
    reports = sub.feeds["a"].full_reports  # its first batch was no full report: the router joined with one
    endpoint, replay = a.pub.endpoint, a.pub.replay_endpoint
    a.pub.close()
    a2 = _rebind(lambda: Replica("a", endpoint, replay, first_seq=2000))  # restarted (seqs from start_seq())
    a2.pub.publish_kv(report_events({}, 16))  # its batch 0, a full report; lost to the router (not subscribed yet)
    a2.pub.follow(lambda: [], interval_s=0.02, heartbeat_s=0.1)
    # The first heartbeat that arrives shows a gap; the replay asked for begins at the restarted run's first
    # batch (AllBlocksCleared): the router takes it as a restart and forgets K[0..2], with no real event.
    wait_until(lambda: _prefix(sub, [K[0]])["a"] == PrefixHit(0, {}))
    feed = sub.feeds["a"]
    assert feed.restarts == 1 and feed.full_reports == reports and feed.lost_batches == 0
    seen = feed.batches
    wait_until(lambda: sub.feeds["a"].batches >= seen + 2)  # heartbeats keep coming while idle
    a2.pub.close()


def test_publish_feed_starts_each_run_above_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.config.events import EventsConfig
    from kvstore.route import publisher as pub_mod

    cfg = EventsConfig(enabled=True, endpoint="tcp://127.0.0.1:0", replay_endpoint=None, heartbeat_s=None)
    seqs = []
    for now_us in (5_000_000, 5_000_001):
        monkeypatch.setattr(pub_mod.time, "time_ns", lambda now_us=now_us: now_us * 1000)
        p = pub_mod.publish_feed(cfg, 16, lambda: [], lambda: {"gpu": []})
        seqs.append(p.last_seq)
        p.close()
    assert seqs == [5_000_000, 5_000_001]  # batch 0 of each run, a microsecond apart


def test_publish_feed_says_its_endpoints_are_unauthenticated_and_warns_off_loopback(
        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from kvstore.config.events import EventsConfig
    from kvstore.route import publisher as pub_mod

    for endpoint, level in (("tcp://127.0.0.1:0", logging.INFO), ("tcp://0.0.0.0:0", logging.WARNING)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=pub_mod.__name__):
            p = pub_mod.publish_feed(EventsConfig(enabled=True, endpoint=endpoint, replay_endpoint=None,
                                                  heartbeat_s=None), 16, lambda: [], lambda: {"gpu": []})
            p.close()
        [record] = [r for r in caplog.records if "unauthenticated" in r.getMessage()]
        assert record.levelno == level, endpoint
        assert ("not loopback-only" in record.getMessage()) == (level == logging.WARNING)


def _ask_report(endpoint: str | None) -> tuple[int, KVEventBatch]:
    assert endpoint is not None
    dealer: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", b"REPORT"])
        assert dealer.poll(5000)
        _, _, seq, payload = dealer.recv_multipart()
        assert dealer.poll(5000) and dealer.recv_multipart()[2] == (-1).to_bytes(8, "big", signed=True)  # end
        return int.from_bytes(seq, "big", signed=True), msgspec.msgpack.decode(payload, type=KVEventBatch)
    finally:
        dealer.close(linger=0)


def test_a_flood_of_report_requests_builds_one_report_per_interval() -> None:
    """Each full report lists every key held: a peer asking again and again gets the last one (as of its
    seq, which the router replays from), and the store builds at most one per ``report_interval_s``."""
    built: list[int] = []
    held = [K[0]]

    def report() -> list:
        built.append(1)
        return report_events({"gpu": list(held)}, 16)

    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "a", buffer_batches=100, report=report,
                         report_interval_s=60.0)
    pub.publish([StoreEvent("stored", K[0], "gpu")])
    answers = [_ask_report(pub.replay_endpoint) for _ in range(50)]
    assert len(built) == 1 and pub.reports_built == 1 and pub.reports_served == 50
    assert {seq for seq, _ in answers} == {0}  # all as of the seq it was built at
    held.append(K[1])
    pub.publish([StoreEvent("stored", K[1], "gpu")])  # newer batches are replayable from the buffer
    assert _ask_report(pub.replay_endpoint)[0] == 0 and len(built) == 1
    pub.close()

    fresh = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "b", buffer_batches=1, report=report,
                           report_interval_s=60.0)
    built.clear()
    fresh.publish([StoreEvent("stored", K[0], "gpu")])
    assert _ask_report(fresh.replay_endpoint)[0] == 0
    fresh.publish([StoreEvent("stored", K[1], "gpu")])
    fresh.publish([StoreEvent("stored", K[2], "gpu")])  # batch 1 has left the one-batch buffer
    seq, batch = _ask_report(fresh.replay_endpoint)
    assert seq == 2 and len(built) == 2  # the old report could not be caught up: a new one is built
    fresh.close()

    every = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "c", report=report, report_interval_s=0)
    built.clear()
    for _ in range(3):
        _ask_report(every.replay_endpoint)
    assert len(built) == 3
    every.close()
