"""One connection's uncommitted reservations never deny the others their puts.

A local client that reserves host slots (PUT_SHM_RESERVE) and never commits, or whose reservations expire
into quarantine, used to take every slot of the arena: every other client's put failed (392 of 392) for as
long as the slots stayed reserved or quarantined (30 hold timeouts, 15 minutes by default). A connection may
now hold at most half of the slots the other connections leave, in write reservations and quarantined slots
together, and nothing more while any of its slots is quarantined; what it asks beyond that is answered BUSY
(a miss for that key, never an error), counted, and logged naming the limit. Real daemon, raw hostile
connections (plain frames, as a buggy or hostile client would send them), the real client library for the
well-behaved client.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest

from daemonlib import (
    observer_stats,
    Daemon, block_for, cleanup, empty_blocks, keys_for, raw_login, raw_unix, read_reply, short_tmpdir, start_daemon,
    write_config,
)
from kvstore.daemon.wire import messages as m
from kvstore.daemon.wire.frames import REPLY_BIT, Op, encode_frame
from kvstore.daemon.client.tier import DaemonTier

SLOTS = 64
"""write_config's host tier: 64 slots of 512 bytes."""


class RawWriter:
    """A logged-in local connection with shared memory that sends PUT_SHM_RESERVE and RELEASE frames itself."""

    def __init__(self, daemon: Daemon) -> None:
        self.sock: socket.socket = raw_unix(daemon)
        raw_login(self.sock, want_shm=True)
        self._rid = 10

    def request(self, op: Op, keys: list[bytes]) -> bytes:
        self._rid += 1
        self.sock.sendall(encode_frame(op, self._rid, m.encode_keys(keys)))
        reply = read_reply(self.sock)
        assert reply is not None and reply[0] == op | REPLY_BIT, reply
        return reply[1]

    def reserve(self, keys: list[bytes]) -> list[m.PutState]:
        """The state the daemon answered for each key."""
        return [m.PutState(st) for st, _ in m.decode_slots(self.request(Op.PUT_SHM_RESERVE, keys), Op.PUT_SHM_RESERVE)]

    def close(self) -> None:
        self.sock.close()


def _counter(daemon: Daemon, name: str) -> int:
    counters = observer_stats(daemon)["counters"]
    assert isinstance(counters, dict)
    return int(counters[name])


def _put_and_read_back(tier: DaemonTier, keys: list[bytes]) -> None:
    """Every block of ``keys`` is stored and read back with its own bytes."""
    stored = tier.put(keys, [block_for(k) for k in keys])
    assert stored == [True] * len(keys), f"{stored.count(False)} of {len(keys)} puts of a well-behaved client refused"
    dests = empty_blocks(len(keys))
    assert tier.get(keys, dests) == [True] * len(keys)
    wrong = [k[:4].hex() for k, b in zip(keys, dests) if not bool((b == block_for(k)).all())]
    assert not wrong, f"blocks read back with other bytes: {wrong}"


def _count(states: list[m.PutState], state: m.PutState) -> int:
    return sum(st == state for st in states)


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    """A daemon whose holds last a minute: nothing here expires unless a test waits for it."""
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root, daemon={"hold_timeout_s": 60.0}))
        yield d
    finally:
        cleanup(d, root)


def test_a_client_that_reserves_the_whole_arena_and_never_commits_leaves_the_others_their_puts(daemon: Daemon) -> None:
    hostile = RawWriter(daemon)
    good = daemon.tier(client_name="good")
    try:
        replies = []
        for round_ in range(6):
            # more keys than the arena holds, fresh each round, plus the first round's again: never committed
            replies.append(hostile.reserve(keys_for(SLOTS + 16, seed=100 + round_)))
            if round_:
                replies.append(hostile.reserve(keys_for(SLOTS // 4, seed=100)))
            _put_and_read_back(good, keys_for(16, seed=200 + round_))
        first = replies[0]
        assert _count(first, m.PutState.RESERVED) == SLOTS // 2, first  # half of the arena; the other half stays the others'
        assert all(st == m.PutState.BUSY for st in first[SLOTS // 2 :])
        assert all(st == m.PutState.BUSY for reply in replies[1:] for st in reply)  # it holds its share already
        refused = _counter(daemon, "share_refused")  # a fresh daemon: every refusal is this test's
        assert refused == sum(_count(r, m.PutState.BUSY) for r in replies)
        assert daemon.metrics_url is not None
        with urllib.request.urlopen(f"{daemon.metrics_url}/metrics", timeout=10) as r:
            samples = [line.split() for line in r.read().decode().splitlines()
                       if line.startswith("kvstore_reserve_share_refused_total")]
        assert samples and all(float(value) == refused for _, value in samples), samples
        assert "half of the 64 host slots" in daemon.log.read_text()  # the refusal is logged naming the limit
    finally:
        hostile.close()
        good.close()


def test_each_further_hostile_connection_leaves_half_of_what_is_left(daemon: Daemon) -> None:
    hostile = [RawWriter(daemon) for _ in range(3)]
    good = daemon.tier(client_name="good")
    try:
        got = [_count(h.reserve(keys_for(SLOTS, seed=300 + i)), m.PutState.RESERVED) for i, h in enumerate(hostile)]
        assert got == [32, 16, 8]
        for round_ in range(4):
            _put_and_read_back(good, keys_for(4, seed=400 + round_))
    finally:
        for h in hostile:
            h.close()
        good.close()


def test_an_owner_with_quarantined_slots_gets_busy_while_another_owner_reserves() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root, daemon={"hold_timeout_s": 1.0}))
        stale, other = RawWriter(d), RawWriter(d)
        mine = keys_for(8, seed=500)
        assert stale.reserve(mine) == [m.PutState.RESERVED] * 8
        deadline = time.monotonic() + 10
        while observer_stats(d)["quarantined_slots"] != 8:  # expired, reaped, kept from reuse: the writer may still copy
            assert time.monotonic() < deadline, observer_stats(d)
            time.sleep(0.1)
        assert stale.reserve(keys_for(4, seed=501)) == [m.PutState.BUSY] * 4  # far below its share, yet quarantined
        theirs = keys_for(4, seed=502)
        assert other.reserve(theirs) == [m.PutState.RESERVED] * 4
        assert m.decode_count(other.request(Op.RELEASE, theirs), Op.RELEASE) == 4
        assert _counter(d, "share_refused") == 4
        assert m.decode_count(stale.request(Op.RELEASE, mine), Op.RELEASE) == 0  # no hold ended: ends its quarantine
        assert stale.reserve(keys_for(4, seed=501)) == [m.PutState.RESERVED] * 4  # its copies are over: it writes again
        stale.close()
        other.close()
    finally:
        cleanup(d, root)
