"""Pieces of the remote tier that need no server: back-off, group arithmetic, group values."""

from __future__ import annotations

import pytest
import torch
from tiers_testlib import LAYOUTS, empty_blocks, make_blocks, make_keys

from kvstore.errors import CorruptBlock
from kvstore.tiers.redis.backoff import Backoff
from kvstore.tiers.chain import groups_of
from kvstore.tiers.redis.group_value import decode_group, encode_group
from kvstore.tiers.redis.evictions import notifications_enabled

L = LAYOUTS["float16"]


def test_backoff_doubles_to_its_cap_and_a_success_closes_it() -> None:
    now = [100.0]
    b = Backoff(0.1, 0.35, clock=lambda: now[0])
    assert b.allow()
    assert [b.failed() for _ in range(4)] == [0.1, 0.2, 0.35, 0.35]
    assert not b.allow() and b.failures == 4
    now[0] += 0.36
    assert b.allow()
    assert b.succeeded() is True and b.succeeded() is False  # the first success after failures is a reconnect
    assert b.failed() == 0.1  # a new run of failures starts small again
    with pytest.raises(ValueError, match="0 < min_s <= max_s"):
        Backoff(1.0, 0.5)


def test_groups_touched_by_a_range_of_positions() -> None:
    assert list(groups_of(0, 8, 4)) == [0, 1] and list(groups_of(5, 6, 4)) == [1]
    assert list(groups_of(3, 9, 4)) == [0, 1, 2] and list(groups_of(4, 4, 4)) == []


def test_group_value_decodes_only_the_blocks_asked_for_and_checks_every_length() -> None:
    keys, blocks = make_keys(L, 4), make_blocks(L, 4)
    value = encode_group(keys, blocks, "zstd", 1, L.fingerprint, L.itemsize)
    dests = empty_blocks(L, 4)
    decode_group(value, keys, {1: dests[1], 3: dests[3]}, L.fingerprint)
    assert torch.equal(dests[1], blocks[1]) and torch.equal(dests[3], blocks[3])
    assert torch.equal(dests[0], empty_blocks(L, 1)[0])  # not asked for: untouched
    with pytest.raises(CorruptBlock, match="truncated"):
        decode_group(value[:-3], keys, {0: dests[0]}, L.fingerprint)
    with pytest.raises(CorruptBlock, match="trailing bytes"):
        decode_group(value + b"\0", keys, {0: dests[0]}, L.fingerprint)
    with pytest.raises(CorruptBlock, match="checksum mismatch"):  # the same value under another chain
        decode_group(value, make_keys(L, 4, seed=9), {2: dests[2]}, L.fingerprint)


@pytest.mark.parametrize(("flags", "on"), [("Exe", True), ("KEA", True), ("Ex", False), ("xe", False), ("", False)])
def test_which_notify_keyspace_events_settings_publish_evictions(flags: str, on: bool) -> None:
    assert notifications_enabled(flags) is on
