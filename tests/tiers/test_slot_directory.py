"""The slot directory (kvstore.tiers.host.slot_directory): the writer keeps it in step with the published slots, a
reader finds exactly those, a copy torn by a reuse is caught, and garbage in the shared table costs a
fallback, never a wrong slot, a crash or a change to what the writer decides."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
from tiers_testlib import LAYOUTS

from kvstore.errors import IntegrityError
from kvstore.tiers.host.tier import HostTier
from kvstore.tiers.host.slot_directory import (
    _HEADER, MAX_PROBE, DirectoryReader, DirectoryWriter, _aligned, directory_bytes,
)


def key(i: int, *, home: int | None = None) -> bytes:
    """A 32-byte key; ``home`` fixes its first 8 bytes (so many keys share a home bucket)."""
    k = hashlib.blake2b(f"k{i}".encode(), digest_size=32).digest()
    return k if home is None else home.to_bytes(8, "little") + k[8:]


def pair(num_slots: int) -> tuple[np.ndarray, DirectoryWriter, DirectoryReader]:
    buf = np.zeros(directory_bytes(num_slots) + 13, dtype=np.uint8)[13:]  # deliberately misaligned start
    writer = DirectoryWriter(buf, num_slots)
    reader = DirectoryReader.attach(buf, num_slots)
    assert reader is not None
    return buf, writer, reader


def found(reader: DirectoryReader, keys: list[bytes]) -> dict[bytes, int]:
    t = reader.begin(keys)
    return {keys[i]: s for i, s in zip(t.index, t.slots)}


@pytest.mark.parametrize("colliding", [False, True])
def test_reader_finds_exactly_the_published_slots_through_random_publishes_and_removals(colliding: bool) -> None:
    num_slots = 24
    _, writer, reader = pair(num_slots)
    rng = random.Random(7)
    universe = [key(i, home=(i % 3) if colliding else None) for i in range(60)]  # colliding: 3 home buckets
    published: dict[bytes, int] = {}
    free = list(range(num_slots))
    for step in range(600):
        if free and (not published or rng.random() < 0.55):
            k = rng.choice([k for k in universe if k not in published])
            slot = free.pop(rng.randrange(len(free)))
            writer.published([k], [slot])
            published[k] = slot
        else:
            slot = published.pop(rng.choice(list(published)))
            writer.unpublished([slot])
            free.append(slot)
        assert writer.check(published) is None, step
        got = found(reader, universe)
        assert all(published[k] == s for k, s in got.items())  # never a wrong slot
        assert len(got) == len(published) - writer.unlisted  # every listed key is found
    assert writer.unlisted == 0  # at most 24 keys in a run of 32 buckets: every one placed


def test_keys_colliding_past_the_probe_limit_are_not_listed_and_readers_miss_them() -> None:
    num_slots = 2 * MAX_PROBE
    _, writer, reader = pair(num_slots)
    keys = [key(i, home=5) for i in range(MAX_PROBE + 6)]  # one home bucket for all
    writer.published(keys, list(range(len(keys))))
    assert writer.unlisted == 6
    got = found(reader, keys)
    assert set(got) == set(keys[:MAX_PROBE]) and all(got[k] == keys.index(k) for k in got)
    writer.unpublished(list(range(MAX_PROBE + 6)))  # listed and unlisted alike
    assert writer.unlisted == 0 and found(reader, keys) == {}
    assert writer.check({}) is None


def test_a_slot_reused_during_the_copy_is_caught_and_an_unchanged_one_confirmed() -> None:
    _, writer, reader = pair(8)
    a, b, c = key(1), key(2), key(3)
    writer.published([a, b], [0, 1])
    ticket = reader.begin([a, b])
    assert reader.confirm(ticket) == [True, True]
    writer.unpublished([0])  # a is evicted ...
    writer.published([c], [0])  # ... and its slot holds c now
    assert reader.confirm(ticket) == [False, True]
    assert found(reader, [a, c]) == {c: 0}


def test_a_slot_being_written_is_not_read() -> None:
    _, writer, reader = pair(8)
    a = key(1)
    writer.published([a], [3])
    writer.unpublished([3])
    assert found(reader, [a]) == {}  # its record still names a, but the seq is odd


def test_garbage_in_the_shared_table_costs_misses_never_a_wrong_slot_a_crash_or_the_writers_state() -> None:
    buf, writer, reader = pair(32)
    keys = [key(i) for i in range(20)]
    writer.published(keys, list(range(20)))
    published = dict(zip(keys, range(20)))
    rng = np.random.default_rng(3)
    body = _aligned(buf)[_HEADER.size + 64 :]  # everything after the header: seqs, records, buckets
    for _ in range(20):
        body[:] = rng.integers(0, 256, size=len(body), dtype=np.uint8)
        got = found(reader, keys + [key(99)])
        assert all(0 <= s < 32 and published.get(k) == s for k, s in got.items())
        assert reader.confirm(reader.begin(keys)) is not None
    assert writer.check(published) is not None  # the writer notices the scribbling ...
    writer.unpublished([0, 1])  # ... and goes on from its own copy, which the garbage never reached
    writer.published([key(50)], [0])
    listed = {e - 1 for e in writer._own_buckets if e}
    assert listed == set(writer._bucket_of) == set(range(2, 20)) | {0}


@pytest.mark.parametrize("field,value", [("magic", b"NOTADIR!"), ("version", 99), ("num_slots", 31),
                                         ("num_buckets", 48), ("max_probe", MAX_PROBE + 1)])
def test_a_header_that_does_not_fit_gives_no_reader(field: str, value: object) -> None:
    buf, _, _ = pair(32)
    head = list(_HEADER.unpack(_aligned(buf)[: _HEADER.size].tobytes()))
    head[["magic", "version", "num_slots", "num_buckets", "max_probe", "key_bytes"].index(field)] = value
    _aligned(buf)[: _HEADER.size] = np.frombuffer(_HEADER.pack(*head), dtype=np.uint8)
    assert DirectoryReader.attach(buf, 32) is None


def test_a_short_buffer_gives_no_reader_and_a_clear_error_to_the_writer() -> None:
    assert DirectoryReader.attach(np.zeros(32, dtype=np.uint8), 8) is None
    with pytest.raises(ValueError, match="needs"):
        DirectoryWriter(np.zeros(100, dtype=np.uint8), 8)


LAYOUT = LAYOUTS["float16"]


def test_a_shared_host_tier_keeps_its_directory_in_step_through_puts_evictions_and_deletes() -> None:
    import torch

    bpb = LAYOUT.bytes_per_block
    tier = HostTier(LAYOUT, 8 * bpb, pin_memory="never", shared_memory=True)
    try:
        assert tier.directory is not None and tier.arena.tail is not None
        reader = DirectoryReader.attach(tier.arena.tail.numpy(), tier.num_slots)
        assert reader is not None
        keys = [key(i) for i in range(20)]
        blocks = [torch.full((bpb,), i, dtype=torch.uint8) for i in range(20)]
        for i in range(0, 20, 4):
            assert tier.put(keys[i : i + 4], blocks[i : i + 4]) == [True] * 4  # evicts from the third batch on
            tier.check_integrity()  # includes the directory against the published slots
        assert tier.delete(keys[16:18]) == 2
        tier.check_integrity()
        got = found(reader, keys)
        assert got == {k: tier.slot_of(k) for k in keys if tier.slot_of(k) is not None} and len(got) == 6
        tier.directory._buckets[:] = 0  # a scribbled shared table is caught by the integrity check
        with pytest.raises(IntegrityError, match="directory"):
            tier.check_integrity()
    finally:
        tier.close()


def test_a_private_host_tier_has_no_directory() -> None:
    tier = HostTier(LAYOUT, 4 * LAYOUT.bytes_per_block, pin_memory="never")
    try:
        assert tier.directory is None and tier.arena.tail is None
    finally:
        tier.close()
