"""Host tier: exact LRU order, pins, reserve/publish/abort, shared memory across processes."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers_testlib import LAYOUTS, empty_blocks, make_blocks, make_keys

from kvstore.config.schema import HostConfig
from kvstore.errors import BlockStateError, TierError
from kvstore.tiers.host.arena import HostArena
from kvstore.tiers.host.tier import HostTier
from kvstore.policy.named import POLICIES
from kvstore.policy.order import make_order

L = LAYOUTS["float16"]
BPB = L.bytes_per_block


def host(slots: int = 4, eviction: str | None = None, **kw: object) -> HostTier:
    """A host tier; ``eviction``: the name of the order to hand it (:func:`make_order`), else LRU."""
    order = make_order(eviction) if eviction is not None else None
    return HostTier(L, slots * BPB + BPB // 2, pin_memory="never", order=order, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", sorted(LAYOUTS))
def test_round_trip_bit_identical(dtype: str) -> None:
    layout = LAYOUTS[dtype]
    tier = HostTier(layout, 8 * layout.bytes_per_block)
    keys, blocks = make_keys(layout, 5), make_blocks(layout, 5, seed=3)
    assert tier.put(keys, blocks) == [True] * 5
    dests = empty_blocks(layout, 5)
    assert tier.get(keys, dests) == [True] * 5
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
    s = tier.stats()
    assert (s.hits, s.num_blocks, s.used_bytes, s.capacity_bytes) == (5, 5, 5 * layout.bytes_per_block, 8 * layout.bytes_per_block)
    tier.check_integrity()
    tier.close()


def test_contains_prefix_stops_at_gap() -> None:
    tier = host(8)
    keys = make_keys(L, 6)
    blocks = make_blocks(L, 6)
    tier.put(keys[:3] + keys[4:], blocks[:3] + blocks[4:])
    assert tier.contains_prefix(keys) == 3
    assert tier.contains_prefix(keys[4:]) == 2
    assert tier.contains_prefix([]) == 0
    assert not tier.contains(keys[3]) and tier.contains(keys[4])


def test_lru_order_exact_and_eviction_events() -> None:
    tier = host(4)
    k = make_keys(L, 6)
    b = make_blocks(L, 6)
    tier.put(k[:4], b[:4])  # a batch is a chain: its last key becomes the oldest, its first the newest
    assert tier.num_free_slots == 0
    assert tier.victims(10) == [k[3], k[2], k[1], k[0]]
    tier.get([k[1]], empty_blocks(L, 1))  # k1 becomes most recent
    assert tier.victims(10) == [k[3], k[2], k[0], k[1]]
    tier.pin([k[0]])  # pinned: skipped, and touched
    assert tier.victims(2) == [k[3], k[2]]
    assert tier.put(k[4:6], b[4:6]) == [True, True]
    assert [e.key for e in tier.drain_events()] == [k[3], k[2]]
    assert tier.drain_events() == []
    assert tier.victims(10) == [k[1], k[5], k[4]]
    assert tier.stats().evictions == 2
    tier.check_integrity()


def test_pinned_slot_never_evicted_or_reused() -> None:
    tier = host(2)
    keys, blocks = make_keys(L, 10), make_blocks(L, 10)
    tier.put(keys[:1], blocks[:1])
    (slot,) = tier.pin(keys[:1])
    for i in range(1, 10):
        assert tier.put([keys[i]], [blocks[i]]) == [True]
        assert tier.slot_of(keys[i]) != slot
    assert torch.equal(tier.slot_view(slot), blocks[0])
    with pytest.raises(BlockStateError, match="pinned"):
        tier.delete([keys[9], keys[0]])
    assert tier.contains(keys[9])  # nothing changed
    tier.unpin(keys[:1])
    with pytest.raises(BlockStateError, match="not pinned"):
        tier.unpin(keys[:1])
    assert tier.delete([keys[0], keys[0], keys[1]]) == 1
    tier.check_integrity()


def test_reserve_publish_abort() -> None:
    tier = host(3)
    k, b = make_keys(L, 3), make_blocks(L, 3)
    slots = tier.reserve(k[:2])
    assert None not in slots and tier.num_free_slots == 1
    assert not tier.contains(k[0]) and tier.slot_of(k[0]) is None
    assert tier.get(k[:1], empty_blocks(L, 1)) == [False]
    assert tier.victims(5) == []
    with pytest.raises(BlockStateError):
        tier.delete(k[:1])
    with pytest.raises(BlockStateError):
        tier.reserve(k[:1])
    tier.slot_view(slots[0]).copy_(b[0])  # type: ignore[arg-type]
    tier.publish(k[:1])
    tier.abort(k[1:2])
    assert tier.num_free_slots == 2
    d = empty_blocks(L, 1)
    assert tier.get(k[:1], d) == [True] and torch.equal(d[0], b[0])
    with pytest.raises(BlockStateError):
        tier.publish(k[1:2])
    tier.check_integrity()


def test_full_of_locked_returns_none_without_blocking() -> None:
    tier = host(2)
    k, b = make_keys(L, 4), make_blocks(L, 4)
    tier.put(k[:2], b[:2])
    tier.pin(k[:2])
    out: list[object] = []
    worker = threading.Thread(target=lambda: out.extend([tier.reserve(k[2:3]), tier.put(k[3:4], b[3:4])]))
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert out == [[None], [False]]
    tier.check_integrity()


def test_no_auto_evict_fails_when_full() -> None:
    tier = host(2, auto_evict=False)
    k, b = make_keys(L, 3), make_blocks(L, 3)
    assert tier.put(k, b) == [True, True, False]
    assert tier.reserve(k[2:]) == [None]
    assert tier.drain_events() == []
    victims = tier.victims(1)
    assert victims == [k[1]] and tier.delete(victims) == 1  # the chain's tail goes first
    assert tier.put(k[2:], b[2:]) == [True]


def test_duplicate_keys_in_one_put() -> None:
    tier = host(4)
    k, b = make_keys(L, 1), make_blocks(L, 1)
    assert tier.put([k[0], k[0]], [b[0], b[0]]) == [True, True]
    assert tier.stats().num_blocks == 1


@given(ops=st.lists(st.tuples(st.sampled_from("pgldu"), st.integers(0, 7)), max_size=80))
@settings(max_examples=40, deadline=None)
def test_random_ops_keep_integrity(ops: list[tuple[str, int]]) -> None:
    tier = host(3)
    keys, blocks = make_keys(L, 8), make_blocks(L, 8)
    pins: dict[bytes, int] = {}
    for op, i in ops:
        key = keys[i]
        if op == "p":
            tier.put([key], [blocks[i]])
        elif op == "g":
            d = empty_blocks(L, 1)
            if tier.get([key], d)[0]:
                assert torch.equal(d[0], blocks[i])
        elif op == "l" and tier.pin([key])[0] is not None:
            pins[key] = pins.get(key, 0) + 1
        elif op == "u" and pins.get(key):
            tier.unpin([key])
            pins[key] -= 1
        elif op == "d" and not pins.get(key):
            tier.delete([key])
        tier.check_integrity()
        for pinned, n in pins.items():
            assert n == 0 or tier.contains(pinned)


def test_threads_share_the_tier() -> None:
    tier = host(6)
    keys, blocks = make_keys(L, 16), make_blocks(L, 16)

    def work(seed: int) -> None:
        for step in range(150):
            i = (seed * 7 + step) % 16
            tier.put([keys[i]], [blocks[i]])
            d = empty_blocks(L, 1)
            if tier.get([keys[(i + 3) % 16]], d)[0]:
                assert torch.equal(d[0], blocks[(i + 3) % 16])

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.check_integrity()


def test_pinning_modes_without_cuda() -> None:
    assert not torch.cuda.is_available()
    with pytest.raises(TierError, match="CUDA"):
        HostTier(L, 4 * BPB, pin_memory="always")
    assert not HostTier(L, 4 * BPB, pin_memory="auto").arena.pinned
    with pytest.raises(TierError, match="at least one slot"):
        HostTier(L, BPB - 1)


_CHILD = """
import sys, torch
from kvstore.tiers.host.arena import HostArena
arena = HostArena.attach(int(sys.argv[1]), "test", int(sys.argv[2]))
view = arena.slot_view(0)
sys.stdout.write(bytes(view.numpy()).hex())
arena.slot_view(1).copy_(view.flip(0))
del view
arena.close()
"""


def test_shared_memory_seen_by_another_process() -> None:
    """Another process maps the arena from its descriptor (as a daemon's client does after login) and sees and
    changes the same bytes; the arena has no name in /dev/shm, and its size cannot change."""
    import os
    before = set(os.listdir("/dev/shm"))
    section = HostConfig(capacity=4 * BPB, shared_memory=True, pin_memory="never")
    tier = HostTier.from_config(section, L)
    assert set(os.listdir("/dev/shm")) == before
    k, b = make_keys(L, 1), make_blocks(L, 1)
    tier.put(k, b)
    slot = tier.slot_of(k[0])
    fd = tier.arena.fd
    assert slot == 0 and fd is not None and tier.shm_name == "kvstore-host"
    for _ in range(2):  # a second attach proves the first child's exit changed nothing for the owner
        out = subprocess.run([sys.executable, "-c", _CHILD, str(fd), str(BPB)], capture_output=True, text=True,
                             check=True, pass_fds=(fd,))
        assert bytes.fromhex(out.stdout) == bytes(b[0].numpy())
        assert "leaked" not in out.stderr and "Warning" not in out.stderr
    assert torch.equal(tier.slot_view(1), b[0].flip(0))
    for size in (0, BPB, 100 * BPB):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size)  # sealed: a truncation would be SIGBUS at the next copy
    tier.close()


def test_attach_refuses_memory_whose_size_is_not_sealed() -> None:
    """A descriptor another process could shrink (a POSIX shm file, a memfd without the seal) is refused:
    mapping it would hand that process a way to make this one's next copy a SIGBUS."""
    import os
    plain = os.memfd_create("unsealed")
    os.ftruncate(plain, 4 * BPB)
    with pytest.raises(TierError, match="'x' is not sealed against shrinking"):
        HostArena.attach(plain, "x", BPB)
    with open("/dev/shm/kvstore-test-%s" % uuid.uuid4().hex[:8], "w+b") as f:
        os.unlink(f.name)
        f.truncate(4 * BPB)
        with pytest.raises(TierError, match="'y' is not sealed against shrinking"):  # tmpfs: F_SEAL_SEAL only
            HostArena.attach(os.dup(f.fileno()), "y", BPB)
    small = HostArena.allocate(2, BPB, pin=False, shared=True)
    assert small.fd is not None
    with pytest.raises(TierError, match="has 131072 bytes, too few for 3 slots|too few for 3 slots"):
        HostArena.attach(os.dup(small.fd), "z", BPB, num_slots=3)
    small.close()


def test_gdsf_order_exact_with_pins_seeds_and_inflation() -> None:
    tier = host(4, eviction="gdsf")
    k, b = make_keys(L, 6), make_blocks(L, 6)
    tier.put(k[:4], b[:4])  # all at L + 1 = 1; published deepest first, so k3 is the oldest use
    tier.get([k[1]], empty_blocks(L, 1))
    tier.get([k[1]], empty_blocks(L, 1))  # k1: count 3
    tier.get([k[0]], empty_blocks(L, 1))  # k0: count 2
    assert tier.victims(1) == [k[3]]  # lowest priority; L rises to 1
    assert tier.put(k[4:5], b[4:5]) == [True]  # full: evicts k3 (priority 1), k4 enters at L + 1 = 2
    assert [e.key for e in tier.drain_events()] == [k[3]]
    tier.pin([k[2]])  # a pin is a use (k2: count 2, priority 3) and shields it
    assert tier.victims(2) == [k[0], k[4]]  # priority 2 each, the older use first; L = 2
    tier.seed_uses([k[4], k[5]], [5, 9])  # k4 restarts at count 5 (priority 7); absent k5 is skipped
    assert tier.victims(3) == [k[0], k[1], k[4]]  # k2 pinned; L = 7
    tier.unpin([k[2]])
    assert tier.victims(1) == [k[0]]
    assert tier.delete([k[0]]) == 1 and tier.put(k[5:6], b[5:6]) == [True]  # k5 enters at L + 1 = 8
    assert tier.victims(4) == [k[1], k[2], k[4], k[5]]  # k1 and k2 both at priority 3: k1's last use is older
    tier.check_integrity()


@pytest.mark.parametrize("placement", ["lru", "s3fifo", "gdsf", "adaptive"])
def test_every_named_policys_host_order_from_config(placement: str) -> None:
    order = POLICIES[placement].orders().host
    tier = HostTier.from_config(HostConfig(capacity=4 * BPB, pin_memory="never"), L, order=order)
    k, b = make_keys(L, 8), make_blocks(L, 8)
    for i in range(8):
        assert tier.put(k[i : i + 1], b[i : i + 1]) == [True]
        tier.check_integrity()
    assert tier.stats().num_blocks == 4 and tier.stats().evictions == 4
    assert tier._order is order  # noqa: SLF001 - the policy's order, not one of its own


def test_a_batch_into_a_full_tier_makes_room_in_one_pass_keeping_pins_and_its_own_present_keys() -> None:
    tier = host(4)
    k, b = make_keys(L, 6), make_blocks(L, 6)
    tier.put(k[:4], b[:4])  # eviction order now k3, k2, k1, k0
    tier.pin([k[0]])
    calls: list[int] = []
    victims = tier._order.victims
    tier._order.victims = lambda n, budget, exclude=(): calls.append(n) or victims(n, budget, exclude)  # type: ignore[method-assign]
    # k1 is in the batch: a use, so not a victim of the batch's two new keys; k0 is pinned.
    assert tier.put([k[4], k[1], k[5]], [b[4], b[1], b[5]]) == [True, True, True]
    assert calls == [2]  # one call for the whole batch, not one per new block
    assert [e.key for e in tier.drain_events()] == [k[3], k[2]] and tier.stats().evictions == 2
    assert all(tier.contains(x) for x in (k[0], k[1], k[4], k[5]))
    d = empty_blocks(L, 4)
    assert tier.get([k[0], k[1], k[4], k[5]], d) == [True] * 4
    assert all(torch.equal(x, y) for x, y in zip(d, [b[0], b[1], b[4], b[5]]))
    tier.check_integrity()


def test_a_full_tier_held_by_many_pins_still_evicts_the_unpinned_and_fails_the_rest() -> None:
    tier = host(64)
    k, b = make_keys(L, 100), make_blocks(L, 100)
    tier.put(k[:64], b[:64])
    tier.pin(k[:48])  # 48 pinned, 16 evictable
    assert tier.reserve(k[64:80]) != [None] * 16 and tier.num_free_slots == 0
    out = tier.put(k[80:84], b[80:84])  # no room: the 16 unpinned slots are reserved, the 48 pinned held
    assert out == [False] * 4 and tier.stats().evictions == 16
    assert all(tier.contains(x) for x in k[:48])
    tier.abort(k[64:80])
    assert tier.put(k[80:84], b[80:84]) == [True] * 4
    tier.check_integrity()


def test_a_batch_reusing_freed_or_evicted_slots_gets_them_consecutive_and_ascending() -> None:
    """So the arena copies it in runs (one memmove per run, ``copy_runs``), whatever order the victims come in."""
    tier = host(8)
    first, second, third = make_keys(L, 8, seed=1), make_keys(L, 8, seed=2), make_keys(L, 4, seed=3)
    assert all(tier.put(first, make_blocks(L, 8)))
    tier.get(first, empty_blocks(L, 8))  # touched deepest first: the eviction order now runs backwards in slots
    assert all(tier.put(second, make_blocks(L, 8)))  # evicts all of `first`
    assert [tier.slot_of(k) for k in second] == list(range(8))
    assert tier.delete(second[2:6]) == 4
    assert all(tier.put(third, make_blocks(L, 4)))
    assert [tier.slot_of(k) for k in third] == [2, 3, 4, 5]
    tier.close()


def test_a_pin_for_the_stores_own_read_is_not_a_use() -> None:
    """A victim pinned to be copied down, or a copy pinned to be written to disk, is read by the store, not
    by a request: counted as a use it would move in LRU, raise a GDSF count and score a duel's miniature."""
    tier = host(4, eviction="gdsf")
    k, b = make_keys(L, 4), make_blocks(L, 4)
    tier.put(k, b)
    before = tier.keys()
    assert tier.pin([k[0]], use=False) == [tier.slot_of(k[0])]
    assert tier.keys() == before and tier._order.count_of(k[0]) == 1  # noqa: SLF001 - the order is the point
    tier.pin([k[0]])  # a request's read: a use
    assert tier._order.count_of(k[0]) == 2  # noqa: SLF001
