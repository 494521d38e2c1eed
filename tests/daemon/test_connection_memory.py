"""A logged-in client cannot make the daemon hold memory.

Measured before: a GET_INLINE naming one key 1,023 times (64 KiB blocks) got a 67 MB reply; replies left
unread and 60 MiB frames sent halfway held hundreds of MB (the only bound was connections x
``max_frame_bytes``); 100 GET_SHMs of one key x16,384 made 1.6 M holds that outlived the connection.
Now repeats are refused, one ``daemon.max_inflight_bytes`` budget bounds payloads and inline replies
across every connection, and holds are bounded per connection and end when it closes.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from daemonlib import Daemon, cleanup, keys_for, raw_login, raw_stats, read_reply, rss, short_tmpdir, start_daemon, write_config

from kvstore.daemon.wire import messages as m
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.wire.frames import HEADER, MAGIC, PROTOCOL_VERSION, REPLY_BIT, ErrorCode, Op, encode_frame
from kvstore.daemon.client.tier import DaemonTier
from kvstore.layout import KVLayout

MODEL = {"model_id": "daemon-64k", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 64,
         "dtype": "float16"}
LAYOUT = KVLayout(**MODEL)
BPB = LAYOUT.bytes_per_block  # 64 KiB
BUDGET = 128 << 20
STORED = 640  # 40 MiB of blocks: one GET_INLINE of all of them is a 40 MiB reply


class Peak:
    """The largest RSS of ``pid`` seen by a thread sampling every 20 ms while in the ``with`` block."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss(self.pid))
            time.sleep(0.02)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root, model=MODEL, host={"capacity": 768 * BPB}, disk={"max_size": "256MiB"},
                                      daemon={"max_inflight_bytes": BUDGET, "read_timeout_s": 3.0,
                                              "hold_timeout_s": 60.0}))
        tier = connect(d)
        keys = keys_for(STORED, seed=901)
        for i in range(0, STORED, 64):
            chunk = keys[i : i + 64]
            assert tier.put(chunk, [torch.full((BPB,), j % 251, dtype=torch.uint8) for j in range(i, i + len(chunk))])
        tier.close()
        yield d
    finally:
        cleanup(d, root)


def connect(d: Daemon) -> DaemonTier:
    client = DaemonClient(LAYOUT, socket_path=d.socket_path)
    client.connect(10)
    return DaemonTier(LAYOUT, client)


def logged_in(d: Daemon, want_shm: bool = False) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(d.socket_path)
    raw_login(s, want_shm, layout=LAYOUT)
    return s


def test_repeated_keys_are_refused_before_any_work(daemon: Daemon) -> None:
    key = keys_for(1, seed=901)
    with logged_in(daemon, want_shm=True) as s:
        for op, n in ((Op.GET_INLINE, 1023), (Op.GET_SHM, 16384), (Op.PUT_SHM_RESERVE, 2)):
            s.sendall(encode_frame(op, 5, m.encode_keys(key * n)))
            reply = read_reply(s)
            assert reply is not None and reply[0] == Op.ERROR
            code, message = m.decode_error(reply[1])
            assert code == ErrorCode.NOT_ALLOWED and f"is named {n} times" in message and "name each key once" in message
        assert raw_stats(s, 6)["holds"] == 0  # not one hold granted


def test_holds_are_bounded_per_connection_and_end_when_it_closes(daemon: Daemon) -> None:
    keys = keys_for(STORED, seed=901)
    limit = 2 * 768  # two per host slot
    with logged_in(daemon, want_shm=True) as s:
        granted = 0
        for rid in range(10, 14):  # 4 x 640 references asked, none released
            s.sendall(encode_frame(Op.GET_SHM, rid, m.encode_keys(keys)))
            reply = read_reply(s)
            assert reply is not None
            if reply[0] == Op.ERROR:
                code, message = m.decode_error(reply[1])
                assert code == ErrorCode.TOO_LARGE and f"at most {limit} per connection" in message and "RELEASE" in message
                break
            granted += len(keys)
        assert granted == 2 * STORED  # the third would pass the limit
        with logged_in(daemon) as watcher:
            assert raw_stats(watcher, 20)["holds"] == granted
            s.close()
            deadline = time.monotonic() + 5  # the hold deadline is 60 s away: the close ends them
            while (holds := raw_stats(watcher, 21)["holds"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert holds == 0


def test_half_sent_frames_hold_no_more_than_the_budget(daemon: Daemon) -> None:
    """Six connections each announce a 60 MiB PUT_INLINE and send all of it but one byte."""
    frame_bytes = 60 << 20
    head = HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.PUT_INLINE, 30, frame_bytes)
    socks = [logged_in(daemon) for _ in range(6)]
    base = rss(daemon.proc.pid)
    chunk = bytes(1 << 20)

    def send(s: socket.socket) -> None:
        try:
            s.sendall(head)
            for _ in range(60):
                s.sendall(chunk[: (1 << 20) - 1] if _ == 59 else chunk)
        except OSError:
            pass  # closed by the daemon: its frame waited past read_timeout_s for room

    with Peak(daemon.proc.pid) as peak:
        senders = [threading.Thread(target=send, args=(s,)) for s in socks]
        for t in senders:
            t.start()
        for t in senders:
            t.join(30)
    for s in socks:
        s.close()
    grown = peak.peak - base
    assert grown < BUDGET + (48 << 20), f"the daemon grew by {grown >> 20} MiB for 6 half-sent frames"
    assert daemon.proc.poll() is None
    with logged_in(daemon) as s:
        deadline = time.monotonic() + 10
        while (inflight := raw_stats(s, 31)["daemon"]["inflight"])["bytes"] and time.monotonic() < deadline:
            time.sleep(0.1)  # the closed connections' sessions end and give their share back
        assert inflight["bytes"] == 0 and inflight["limit"] == BUDGET  # nothing leaked: still serving
        assert inflight["waited"] >= 1 and inflight["refused"] >= 1  # frames that found no room waited, then closed


def test_inline_replies_left_unread_hold_no_more_than_the_budget(daemon: Daemon) -> None:
    """Six connections each ask for all 640 blocks inline (a 40 MiB reply) and never read it."""
    keys = keys_for(STORED, seed=901)
    base = rss(daemon.proc.pid)
    socks = [logged_in(daemon) for _ in range(6)]
    with Peak(daemon.proc.pid) as peak:
        for s in socks:
            s.sendall(encode_frame(Op.GET_INLINE, 40, m.encode_keys(keys)))
        time.sleep(5)  # past read_timeout_s: the unread ones are closed, the waiting ones answered UNAVAILABLE
    grown = peak.peak - base
    for s in socks:
        s.close()
    assert grown < BUDGET + (48 << 20), f"the daemon grew by {grown >> 20} MiB for 6 unread 40 MiB replies"
    tier = connect(daemon)  # and it serves a reader that reads
    got = [torch.empty(BPB, dtype=torch.uint8) for _ in range(64)]
    assert tier.get(keys[:64], got) == [True] * 64
    assert all(bool((g == j % 251).all()) for j, g in enumerate(got))
    tier.close()
