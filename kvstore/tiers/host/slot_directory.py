"""Which host slot holds which key, in shared memory, for clients that read without asking the daemon.

The daemon's host tier writes it (one writer, under the tier's lock); a
local client maps it read-only in spirit (it never writes it) and looks keys
up itself, so a get of blocks already in host memory needs no round trip::

    header   magic "KVSDIR01", version, num_slots, num_buckets, max_probe, key_bytes
    seq      u64 per slot: odd = not published (free or being written), even = published
    keys     32 bytes per slot: the key of the block in it (valid while seq is even)
    buckets  i32 per bucket, open addressing: slot + 1, 0 = empty

A read is a seqlock per slot (:meth:`DirectoryReader.begin`, copy,
:meth:`DirectoryReader.confirm`): read the slot's seq (it must be even),
then its key (it must be the one asked for), copy the slot's bytes, read the
seq again. The writer makes a slot's seq odd before the slot is freed (so
before anyone may write into it again) and even only after the key is
written and the bytes are in place, so an unchanged even seq around the copy
proves the bytes copied are the block of that key. A slot evicted and
reused during the copy changes its seq: that key is then asked of the daemon
as before. The proof relies on x86-64's memory order (stores seen in the
order made, loads not reordered with loads); elsewhere clients do not read
the directory (:func:`reads_supported`).

Nothing in the shared table is trusted: the writer keeps its own copy of
every bucket and seq and only ever writes the shared ones, so a client that
scribbles on the segment changes nothing the daemon decides, and a reader
checks every slot number it finds against ``num_slots`` and every key
against the slot's record, so garbage there costs a round trip, never a
wrong block or a crash. A probe stops after ``max_probe`` buckets; a key
the writer cannot place within them (hostile keys chosen to collide) is
simply not listed, and readers ask the daemon for it.
"""

from __future__ import annotations

import platform
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAGIC = b"KVSDIR01"
VERSION = 1
KEY_BYTES = 32
MAX_PROBE = 32
"""Most buckets a key may sit past its home bucket; the writer does not list a key it cannot place within them."""
_HEADER = struct.Struct("<8sIIIII")
_HEADER_BYTES = 64
_ALIGN = 64


def _buckets_for(num_slots: int) -> int:
    """A power of two at least twice ``num_slots`` (load factor at most 1/2)."""
    return 1 << max(4, (2 * num_slots - 1).bit_length())


def _layout(num_slots: int, num_buckets: int) -> tuple[int, int, int, int]:
    """Offsets of seq, keys and buckets, and the total size in bytes."""
    def up(n: int) -> int:
        return (n + _ALIGN - 1) // _ALIGN * _ALIGN
    seq_at = _HEADER_BYTES
    keys_at = up(seq_at + 8 * num_slots)
    buckets_at = up(keys_at + KEY_BYTES * num_slots)
    return seq_at, keys_at, buckets_at, buckets_at + 4 * num_buckets


def directory_bytes(num_slots: int) -> int:
    """Bytes a directory for ``num_slots`` slots takes (what the arena appends to its segment), with room to
    start it on a 64-byte boundary (an 8-byte seq store must not straddle a cache line to be atomic)."""
    return _layout(num_slots, _buckets_for(num_slots))[3] + _ALIGN


def _aligned(buf: np.ndarray) -> np.ndarray:
    """``buf`` (``uint8``) from its first 64-byte-aligned byte: the same offset in every process mapping it,
    since mappings start on page boundaries."""
    skip = -buf.ctypes.data % _ALIGN
    return buf[skip:]


def reads_supported() -> bool:
    """Whether this machine's memory order makes the seqlock read sound (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _arrays(buf: np.ndarray, num_slots: int, num_buckets: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of ``buf`` (aligned, ``uint8``): seq per slot, key per slot (rows), buckets."""
    seq_at, keys_at, buckets_at, total = _layout(num_slots, num_buckets)
    if len(buf) < total:
        raise ValueError(f"slot directory for {num_slots} slots needs {total} bytes, got {len(buf)}")
    seq = buf[seq_at : seq_at + 8 * num_slots].view("<u8")
    keys = buf[keys_at : keys_at + KEY_BYTES * num_slots].reshape(num_slots, KEY_BYTES)
    return seq, keys, buf[buckets_at : buckets_at + 4 * num_buckets].view("<i4")


def _homes(keys: np.ndarray, mask: int) -> np.ndarray:
    """Home bucket of each key (rows of ``keys``): its first 8 bytes, little-endian, masked."""
    return np.ascontiguousarray(keys[:, :8]).view("<u8").ravel() & np.uint64(mask)


class DirectoryWriter:
    """The daemon's side: keeps the shared table in step with the host tier's published keys."""

    def __init__(self, buf: np.ndarray, num_slots: int) -> None:
        """Lay a fresh, empty directory for ``num_slots`` slots over ``buf`` (``uint8``, at least
        :func:`directory_bytes`)."""
        buf = _aligned(buf)
        self.num_slots = num_slots
        self.num_buckets = _buckets_for(num_slots)
        self._mask = self.num_buckets - 1
        self._max_probe = min(MAX_PROBE, self.num_buckets)
        self._seq, self._keys, self._buckets = _arrays(buf, num_slots, self.num_buckets)
        self._own_seq = np.ones(num_slots, dtype=np.uint64)  # every slot starts unpublished (odd)
        self._own_buckets = np.zeros(self.num_buckets, dtype=np.int32)  # 4 bytes a bucket, not a list's 8
        self._bucket_of: dict[int, int] = {}  # listed slot -> its bucket
        self._home: dict[int, int] = {}  # listed slot -> its key's home bucket
        self._seq[:] = self._own_seq
        self._buckets[:] = 0
        buf[:_HEADER.size] = np.frombuffer(
            _HEADER.pack(MAGIC, VERSION, num_slots, self.num_buckets, self._max_probe, KEY_BYTES), dtype=np.uint8)
        self._unlisted: set[int] = set()
        """Published slots whose key is not listed (no free bucket within the probe limit of its home)."""

    @property
    def unlisted(self) -> int:
        """Keys published but not listed (no free bucket within :data:`MAX_PROBE` of their home): readers miss
        them and ask the daemon."""
        return len(self._unlisted)

    def published(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """``keys[i]`` is now published in ``slots[i]`` (its bytes already in place). Hold the tier's lock."""
        if not keys:
            return
        idx = np.fromiter(slots, dtype=np.int64, count=len(slots))
        rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), KEY_BYTES)
        self._keys[idx] = rows  # the key first ...
        self._own_seq[idx] += np.uint64(1)
        self._seq[idx] = self._own_seq[idx]  # ... then the even seq that vouches for it
        for slot, home in zip(slots, _homes(rows, self._mask).tolist()):
            self._insert(slot, home)

    def unpublished(self, slots: Sequence[int]) -> None:
        """These slots' blocks are gone (evicted, deleted): readers must stop trusting them. Hold the tier's lock."""
        if not slots:
            return
        idx = np.fromiter(slots, dtype=np.int64, count=len(slots))
        self._own_seq[idx] += np.uint64(1)
        self._seq[idx] = self._own_seq[idx]  # odd: before the slot can be handed out again
        for slot in slots:
            self._remove(slot)

    def _insert(self, slot: int, home: int) -> None:
        buckets, mask = self._own_buckets, self._mask
        for step in range(self._max_probe):
            b = (home + step) & mask
            if buckets[b] == 0:
                buckets[b] = slot + 1
                self._buckets[b] = slot + 1
                self._bucket_of[slot] = b
                self._home[slot] = home
                return
        self._unlisted.add(slot)

    def _remove(self, slot: int) -> None:
        """Empty the slot's bucket and shift later entries of the run back (no tombstones, no rebuilds)."""
        hole = self._bucket_of.pop(slot, None)
        if hole is None:
            self._unlisted.discard(slot)
            return
        del self._home[slot]
        buckets, mask = self._own_buckets, self._mask
        j = hole
        while True:
            j = (j + 1) & mask
            entry = int(buckets[j])
            if entry == 0:
                break
            home = self._home[entry - 1]
            # The entry may move into the hole unless its home lies cyclically in (hole, j].
            if (j - home) & mask >= (j - hole) & mask:
                buckets[hole] = entry
                self._buckets[hole] = entry
                self._bucket_of[entry - 1] = hole
                hole = j
        buckets[hole] = 0
        self._buckets[hole] = 0

    def check(self, published: dict[bytes, int]) -> str | None:
        """What is wrong with the shared table against the tier's ``published`` map (``None``: nothing)."""
        seq = self._seq.copy()
        if not np.array_equal(seq, self._own_seq):
            return "shared seq differs from the writer's"
        even = {int(s) for s in np.flatnonzero((seq & 1) == 0)}
        if even != set(published.values()):
            return f"{len(even)} slots marked published, the tier has {len(published)}"
        for key, slot in published.items():
            if bytes(self._keys[slot]) != key:
                return f"slot {slot} records another key"
        listed = {int(e) - 1 for e in self._own_buckets if e}
        if listed != set(self._bucket_of) or not listed <= even or len(listed) + len(self._unlisted) != len(published):
            return "buckets and listed slots disagree"
        if not np.array_equal(self._buckets, self._own_buckets):
            return "shared buckets differ from the writer's"
        return None


@dataclass
class ReadTicket:
    """What :meth:`DirectoryReader.begin` found: positions in the request, their slots, the seqs read."""

    index: list[int]
    slots: list[int]
    seqs: list[int]


class DirectoryReader:
    """A client's side: finds keys' slots and proves a copy out of them was not torn by a reuse.

    A get asks for a few to a few hundred keys, so the lookup is a plain loop over memoryviews of the
    shared arrays (under a microsecond a key), not array operations (a few microseconds each, whatever
    their size)."""

    def __init__(self, seq: np.ndarray, keys: np.ndarray, buckets: np.ndarray, num_slots: int, max_probe: int) -> None:
        self._arrays = (seq, keys, buckets)  # the views below read them
        self._seq = seq.data.cast("B").cast("Q")  # native order: reads_supported() means x86-64, little-endian
        self._keys = keys.data.cast("B")
        self._buckets = buckets.data.cast("B").cast("i")
        self.num_slots = num_slots
        self._mask = len(buckets) - 1
        self._max_probe = max_probe

    @classmethod
    def attach(cls, buf: np.ndarray, num_slots: int) -> DirectoryReader | None:
        """The directory in ``buf`` (``uint8``) for an arena of ``num_slots`` slots, or ``None`` when ``buf``
        holds none (an older daemon, another layout, a damaged header): the client then asks the daemon for
        every get."""
        buf = _aligned(buf)
        if len(buf) < _HEADER_BYTES:
            return None
        magic, version, n, num_buckets, max_probe, key_bytes = _HEADER.unpack(buf[:_HEADER.size].tobytes())
        if (magic != MAGIC or version != VERSION or n != num_slots or key_bytes != KEY_BYTES
                or num_buckets < 1 or num_buckets & (num_buckets - 1) or not 1 <= max_probe <= min(MAX_PROBE, num_buckets)):
            return None
        if len(buf) < _layout(n, num_buckets)[3]:
            return None
        return cls(*_arrays(buf, n, num_buckets), n, max_probe)

    def begin(self, keys: Sequence[bytes]) -> ReadTicket:
        """Find each key's slot and read its seq: the keys listed, published and recorded in their slot.

        Copy out of ``ticket.slots`` next, then :meth:`confirm`. Keys not found are simply absent from the
        ticket (ask the daemon for them). Everything read is checked: slot numbers against ``num_slots``,
        keys against the slot's record, read after the slot's seq."""
        buckets, seqs, records = self._buckets, self._seq, self._keys
        mask, num_slots, probes = self._mask, self.num_slots, self._max_probe
        ticket = ReadTicket([], [], [])
        index, slots, seen = ticket.index, ticket.slots, ticket.seqs
        homes = memoryview(b"".join(keys)).cast("Q")[::KEY_BYTES // 8].tolist()  # each key's first 8 bytes
        for i, (key, pos) in enumerate(zip(keys, homes)):
            pos &= mask
            for _ in range(probes):
                entry = buckets[pos]
                if not entry:
                    break
                slot = entry - 1
                if 0 <= slot < num_slots:  # the shared table is not trusted: a scribbled entry is skipped
                    seq = seqs[slot]  # the seq first, then the key it vouches for
                    at = slot * KEY_BYTES
                    if records[at : at + KEY_BYTES] == key:
                        if not seq & 1:
                            index.append(i)
                            slots.append(slot)
                            seen.append(seq)
                        break
                pos = (pos + 1) & mask
        return ticket

    def confirm(self, ticket: ReadTicket) -> list[bool]:
        """After the copy: which of the ticket's entries still hold the same publication (one per entry)."""
        seqs = self._seq
        return [seqs[slot] == seq for slot, seq in zip(ticket.slots, ticket.seqs)]
