"""RELEASE_QUIET (protocol 3): a get's RELEASE without a reply, against a live daemon (since protocol 4 a get's
release usually rides in the next get's frame, GET_SHM_RELEASE: test_get_release.py).

It ends the holds like RELEASE; it is never answered, not even when it is malformed (an unasked reply
would be read as the next request's), so the connection stays in step; before login it is refused
like any other request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from daemonlib import (
    Daemon, block_for, cleanup, empty_blocks, expect_error, keys_for, raw_login, raw_stats, raw_unix, short_tmpdir,
    start_daemon, write_config,
)
from kvstore.daemon.wire import messages as m
from kvstore.daemon.wire.frames import ErrorCode, Op, encode_frame


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root))
        yield d
    finally:
        cleanup(d, root)


def test_a_get_releases_its_holds_with_no_reply(daemon: Daemon) -> None:
    tier = daemon.tier(read_directory=False)  # the held path: GET_SHM, copy, release
    try:
        keys = keys_for(4, seed=41)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 4
        before = tier.client.stats()
        dests = empty_blocks(4)
        with tier.client.lock:  # the flusher cannot send a deferred release on its own meanwhile
            for _ in range(3):
                assert tier.get(keys, dests) == [True] * 4
        after = tier.client.stats()  # a request after the RELEASE_QUIETs: they ran before it, in order
        assert after["holds"] == 0  # every hold the gets took has ended
        reqs_before, reqs = before["daemon"]["requests"], after["daemon"]["requests"]
        quiet = reqs.get("RELEASE_QUIET", 0) - reqs_before.get("RELEASE_QUIET", 0)
        carried = reqs.get("GET_SHM_RELEASE", 0) - reqs_before.get("GET_SHM_RELEASE", 0)
        assert (quiet, carried) == (1, 2)  # two rode in the next get, the last went ahead of STATS
        assert reqs.get("RELEASE", 0) == reqs_before.get("RELEASE", 0)  # the get path sends no RELEASE
    finally:
        tier.close()


def test_a_malformed_release_quiet_is_counted_never_answered_and_the_connection_stays_in_step(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        raw_login(s)
        errors_before = raw_stats(s, 2)["daemon"]["errors"].get("BAD_FRAME", 0)
        s.sendall(encode_frame(Op.RELEASE_QUIET, 3, b"\x05\x00\x00\x00" + b"k" * 32))  # says 5 keys, carries 1
        s.sendall(encode_frame(Op.RELEASE_QUIET, 4, m.encode_keys(keys_for(2, seed=42))))  # keys it never held
        too_many = raw_stats(s, 5)["daemon"]["errors"].get("TOO_LARGE", 0)
        s.sendall(encode_frame(Op.RELEASE_QUIET, 6, m.encode_keys(keys_for(16385, seed=44))))  # over max_keys
        after = raw_stats(s, 7)  # no reply came for any of them: the next frame is STATS's
        assert after["daemon"]["errors"].get("BAD_FRAME", 0) == errors_before + 1
        assert after["daemon"]["errors"].get("TOO_LARGE", 0) == too_many + 1


def test_release_quiet_before_login_is_refused_and_the_connection_closed(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        s.sendall(encode_frame(Op.RELEASE_QUIET, 1, m.encode_keys(keys_for(1, seed=43))))
        assert "before HELLO" in expect_error(s, ErrorCode.UNAUTHORIZED, closed=True)


def test_a_deferred_release_goes_out_alone_when_no_request_follows(daemon: Daemon) -> None:
    """The get's RELEASE_QUIET waits for the next request to travel with; with none, the client's flusher
    sends it within about QUIET_DELAY_S, so an idle engine pins no host slots until the hold deadline."""
    tier, watcher = daemon.tier(read_directory=False), daemon.tier()
    try:
        keys = keys_for(4, seed=45)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 4
        assert tier.get(keys, empty_blocks(4)) == [True] * 4
        deadline = time.monotonic() + 1.0  # well inside the 2 s hold timeout: the deadline did not end them
        while watcher.client.stats()["holds"] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert watcher.client.stats()["holds"] == 0
    finally:
        tier.close()
        watcher.close()


def test_close_sends_a_deferred_release_first(daemon: Daemon) -> None:
    tier, watcher = daemon.tier(read_directory=False), daemon.tier()
    keys = keys_for(3, seed=46)
    assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 3
    with tier.client.lock:  # the flusher cannot send it while the lock is held
        assert tier.get(keys, empty_blocks(3)) == [True] * 3
        assert tier.client._quiet  # deferred, not sent yet
        tier.client.close()
    try:
        deadline = time.monotonic() + 1.0
        while watcher.client.stats()["holds"] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert watcher.client.stats()["holds"] == 0
    finally:
        watcher.close()
