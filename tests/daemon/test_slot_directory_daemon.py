"""Gets through the daemon's slot directory (protocol 5), against a live daemon: blocks in its host tier are
copied with no request, their reads reach the daemon's counters and eviction order (TOUCH_QUIET), a copy torn
by an eviction is caught and the block fetched again, and TOUCH_QUIET from a connection that may not send it,
or malformed, or too large, is counted, never answered, and changes nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from daemonlib import (
    LAYOUT, Daemon, block_for, cleanup, empty_blocks, expect_error, keys_for, raw_login, raw_stats, raw_unix,
    short_tmpdir, start_daemon, write_config,
)
from kvstore.daemon.wire import messages as m
from kvstore.daemon.wire.frames import ErrorCode, Op, encode_frame
from kvstore.daemon.client.tier import DaemonTier
from kvstore.tiers.host.slot_directory import ReadTicket


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root))  # 64 host slots in front of LMDB
        yield d
    finally:
        cleanup(d, root)


def _requests(tier: DaemonTier) -> dict[str, int]:
    """The daemon's request counts by op, read on ``tier``'s connection (so after anything it deferred)."""
    return tier.client.stats()["daemon"]["requests"]


def _delta(after: dict[str, int], before: dict[str, int], op: str) -> int:
    return after.get(op, 0) - before.get(op, 0)


def test_host_blocks_are_read_with_no_request_and_the_reads_are_counted(daemon: Daemon) -> None:
    tier = daemon.tier()
    try:
        assert tier.client.directory is not None
        keys = keys_for(12, seed=501)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 12
        before = tier.client.stats()
        dests = empty_blocks(12)
        with tier.client.lock:  # nothing is sent meanwhile: not even the deferred report
            assert tier.get(keys, dests) == [True] * 12
        assert all(bool((d == block_for(k)).all()) for k, d in zip(keys, dests))
        after = tier.client.stats()  # the report went ahead of this request
        reqs, reqs_before = after["daemon"]["requests"], before["daemon"]["requests"]
        assert _delta(reqs, reqs_before, "GET_SHM") == 0 and _delta(reqs, reqs_before, "GET_SHM_RELEASE") == 0
        assert _delta(reqs, reqs_before, "TOUCH_QUIET") == 1
        assert after["counters"]["host_hits"] - before["counters"]["host_hits"] == 12
        assert after["counters"]["bytes_out"] - before["counters"]["bytes_out"] == 12 * LAYOUT.bytes_per_block
        assert after["holds"] == 0  # a read through the directory takes none
    finally:
        tier.close()


def test_a_block_not_in_host_memory_is_asked_of_the_daemon(daemon: Daemon) -> None:
    tier = daemon.tier()
    try:
        keys = keys_for(3, seed=502)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 3
        tier.flush()  # on disk too
        before = _requests(tier)
        absent = keys_for(1, seed=503)
        assert tier.get(keys + absent, empty_blocks(4)) == [True, True, True, False]
        assert _delta(_requests(tier), before, "GET_SHM") + _delta(_requests(tier), before, "GET_SHM_RELEASE") == 1
    finally:
        tier.close()


def test_reads_through_the_directory_keep_blocks_recent_in_the_daemons_eviction_order(daemon: Daemon) -> None:
    tier, watcher = daemon.tier(), daemon.tier()
    try:
        old, new, more = keys_for(32, seed=504), keys_for(32, seed=505), keys_for(16, seed=506)
        assert tier.put(old, [block_for(k) for k in old]) == [True] * 32
        assert tier.put(new, [block_for(k) for k in new]) == [True] * 32  # 64 slots, now full
        tier.flush()  # written through: nothing pinned by the writer
        assert tier.get(old, empty_blocks(32)) == [True] * 32  # through the directory
        assert tier.put(more, [block_for(k) for k in more]) == [True] * 16  # its frames carry the report first
        tier.flush()
        directory = watcher.client.directory
        assert directory is not None
        in_host = set(directory.begin(old).index)
        assert in_host == set(range(32))  # the blocks just read stayed; the 16 evicted came from `new`
        assert len(directory.begin(new).index) == 16
    finally:
        tier.close()
        watcher.close()


def test_a_copy_torn_by_an_eviction_is_caught_and_the_block_fetched_again_from_disk(daemon: Daemon) -> None:
    tier, other = daemon.tier(), daemon.tier()
    try:
        victim = keys_for(1, seed=507)
        assert tier.put(victim, [block_for(victim[0])]) == [True]
        tier.flush()  # on disk, so still found once evicted from host
        directory = tier.client.directory
        assert directory is not None
        real_begin = directory.begin
        tickets: list[ReadTicket] = []

        def begin_then_evict(keys: list[bytes]) -> ReadTicket:
            ticket = real_begin(keys)
            tickets.append(ticket)
            filler = keys_for(80, seed=508)  # more than the 64 slots: the victim's slot is reused
            assert other.put(filler, [block_for(k) for k in filler]) == [True] * 80
            other.flush()
            return ticket

        directory.begin = begin_then_evict  # type: ignore[method-assign]
        before = _requests(tier)
        dest = empty_blocks(1)
        assert tier.get(victim, dest) == [True]
        directory.begin = real_begin  # type: ignore[method-assign]
        assert tickets and tickets[0].index == [0]  # the directory did list it when the get began
        assert directory.confirm(tickets[0]) == [False]  # its slot was republished under another key meanwhile
        assert bool((dest[0] == block_for(victim[0])).all())  # the torn copy was not kept: the disk's block is
        assert _delta(_requests(tier), before, "GET_SHM") + _delta(_requests(tier), before, "GET_SHM_RELEASE") == 1
    finally:
        tier.close()
        other.close()


def test_a_client_that_does_not_read_the_directory_asks_for_every_get(daemon: Daemon) -> None:
    tier = daemon.tier(read_directory=False)
    try:
        assert tier.client.directory is None
        keys = keys_for(4, seed=509)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 4
        before = _requests(tier)
        dests = empty_blocks(4)
        assert tier.get(keys, dests) == [True] * 4
        assert all(bool((d == block_for(k)).all()) for k, d in zip(keys, dests))
        after = _requests(tier)
        assert _delta(after, before, "GET_SHM") + _delta(after, before, "GET_SHM_RELEASE") == 1
        assert _delta(after, before, "TOUCH_QUIET") == 0
    finally:
        tier.close()


# ---------------------------------------------------------------- hostile or broken TOUCH_QUIET
def test_touch_quiet_without_shared_memory_is_refused_counted_and_never_answered(daemon: Daemon) -> None:
    tier = daemon.tier()
    keys = keys_for(2, seed=510)
    assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 2
    tier.close()
    with raw_unix(daemon) as s:
        raw_login(s, want_shm=False)  # a client without the arena has read nothing out of it
        before = raw_stats(s, 2)
        s.sendall(encode_frame(Op.TOUCH_QUIET, 3, m.encode_keys(keys)))
        after = raw_stats(s, 4)  # no reply came for it: the next frame is STATS's
        assert after["daemon"]["errors"].get("NOT_ALLOWED", 0) == before["daemon"]["errors"].get("NOT_ALLOWED", 0) + 1
        assert after["counters"]["host_hits"] == before["counters"]["host_hits"]  # it counted nothing


def test_a_malformed_or_oversized_touch_quiet_is_counted_never_answered_and_changes_nothing(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        raw_login(s, want_shm=True)
        before = raw_stats(s, 2)
        s.sendall(encode_frame(Op.TOUCH_QUIET, 3, b"\x05\x00\x00\x00" + b"k" * 32))  # says 5 keys, carries 1
        s.sendall(encode_frame(Op.TOUCH_QUIET, 4, m.encode_keys(keys_for(16385, seed=511))))  # over max_keys
        s.sendall(encode_frame(Op.TOUCH_QUIET, 5, m.encode_keys(keys_for(3, seed=512))))  # keys it never stored
        after = raw_stats(s, 6)
        errors, errors_before = after["daemon"]["errors"], before["daemon"]["errors"]
        assert errors.get("BAD_FRAME", 0) == errors_before.get("BAD_FRAME", 0) + 1
        assert errors.get("TOO_LARGE", 0) == errors_before.get("TOO_LARGE", 0) + 1
        assert after["counters"]["host_hits"] == before["counters"]["host_hits"]  # absent keys count no hit
        assert after["host"]["num_blocks"] == before["host"]["num_blocks"]


def test_touch_quiet_before_login_is_refused_and_the_connection_closed(daemon: Daemon) -> None:
    with raw_unix(daemon) as s:
        s.sendall(encode_frame(Op.TOUCH_QUIET, 1, m.encode_keys(keys_for(1, seed=513))))
        assert "before HELLO" in expect_error(s, ErrorCode.UNAUTHORIZED, closed=True)


def test_where_the_seqlock_read_is_not_sound_the_client_maps_no_directory(daemon: Daemon,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstore.tiers.host.slot_directory as sd

    monkeypatch.setattr(sd, "reads_supported", lambda: False)  # as on a machine other than x86-64
    tier = daemon.tier()
    try:
        assert tier.client.arena is not None and tier.client.directory is None
        keys = keys_for(3, seed=514)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 3
        before = _requests(tier)
        dests = empty_blocks(3)
        assert tier.get(keys, dests) == [True] * 3
        assert all(bool((d == block_for(k)).all()) for k, d in zip(keys, dests))
        after = _requests(tier)
        assert _delta(after, before, "GET_SHM") + _delta(after, before, "GET_SHM_RELEASE") == 1
    finally:
        tier.close()
