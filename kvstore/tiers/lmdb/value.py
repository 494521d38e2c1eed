"""A value's size and place in LMDB's map, checked before any of its bytes is touched.

LMDB trusts the data size in a leaf node. One flipped bit there (bit 23 turns a 65,584-byte value into
8,454,192 bytes) points the value past the end of ``data.mdb`` (a ``SIGBUS`` on the first touch) or of
the map (``SIGSEGV``); no ``except`` catches either, and every py-lmdb call that returns a value
(``Transaction.get``, ``Cursor.value``, ``Cursor.item``, iteration with values) first touches each of
its pages ("preload"). So the tiers read a block in two steps (:func:`bounded_value`):
``Cursor.set_key`` positions a cursor and ``Cursor.key`` returns the key where it lies in its leaf
node (neither touches the value); the node's header sits right before the key and says where the value
is (LMDB's ``MDB_node``)::

    key - 8   uint16 size low, uint16 size high, uint16 flags (F_BIGDATA 0x01), uint16 key size
    key + ksize   the value itself, or (F_BIGDATA) a uint64 page number: the value starts 16 bytes
                  into that page, an overflow page (flags at offset 10: P_OVERFLOW 0x04) whose
                  uint32 at offset 12 counts the pages of its run

The value must lie inside that run (or inside its leaf page), inside the pages LMDB wrote that the
file holds, and be no longer than the codec writes for one block. Only then is it fetched
(``Cursor.value``, whose preload now stays within what was checked) and handed to
:func:`kvstore.tiers.codec.decode_into`, which verifies its bytes. A value that fails is
:class:`ValueOutOfBounds`: ``deletable`` when it sits on overflow pages (deleting such a node frees the
run its page header counts and never reads the bad size), not when it is inside its leaf (LMDB's node
delete moves that many bytes within the page: the block stays, a counted miss, until ``kvstore repair``).

Pages a write transaction changed live outside the map (LMDB copies them to the heap): an in-leaf value
there is checked against the codec's bound only. The pages written are read once per
:class:`MapWindow`, that is per read transaction, from the map's meta pages; a file truncated while the
process runs (after the open-time check of :mod:`kvstore.tiers.lmdb.check`) is outside what this can see.

Cost, measured on the dev VM: ~2.5 us per block (``Transaction.get`` took 0.2), most of it reading the
key's address through the buffer protocol; 15-25% of a warm 64 KiB read, about 1% at the default
model's blocks (720 KiB).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import lmdb

from kvstore.errors import CorruptBlock

PAGE_HEADER = 16
"""Bytes of LMDB's page header; an overflow value starts right after it."""
P_OVERFLOW = 0x04
F_BIGDATA = 0x01
_FLAGS_PAGES = struct.Struct("<HI")  # mp_flags at offset 10, mp_pages at offset 12 of a page header
_NODE_HEADER = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize: the 8 bytes before a node's key
_META_LAST = struct.Struct("<QQ")  # a meta page's last page number and transaction id, at offset 136
_META_LAST_OFFSET = 136
_PGNO = struct.Struct("<Q")  # a big value's first page (pgno_t is size_t: 64-bit builds only)


class ValueOutOfBounds(CorruptBlock):
    """A value whose size or place is not one LMDB could have written (a damaged node): never touched.

    ``deletable``: whether deleting its node is safe (the value is on overflow pages)."""

    def __init__(self, key: bytes, detail: str, *, deletable: bool) -> None:
        super().__init__(key, "out of bounds", detail)
        self.deletable = deletable


def file_mappings(data_file: str) -> set[int]:
    """Start addresses of this process's mappings of ``data_file`` from its first byte (``/proc/self/maps``;
    empty where there is none or no such file). LMDB does not say where it mapped an environment
    (``Environment.info()["map_addr"]`` is 0 unless the map is fixed): an opener compares this set before
    and after it maps (:func:`new_mapping`)."""
    try:
        st = os.stat(data_file)
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return set()
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"  # an inode number is unique per device only
    found = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) >= 5 and fields[4] == str(st.st_ino) and fields[3] == device and int(fields[2], 16) == 0:
            found.add(int(fields[0].split("-")[0], 16))
    return found


def new_mapping(data_file: str, before: set[int]) -> int | None:
    """The start of the one mapping of ``data_file`` made since ``before`` was taken; ``None`` if there is
    not exactly one (no ``/proc``: values are then checked against the codec's bound only)."""
    made = file_mappings(data_file) - before
    return made.pop() if len(made) == 1 else None


@dataclass(frozen=True)
class MapWindow:
    """Where values of one transaction may lie: ``[start, end)`` of the process's address space."""

    start: int
    map_end: int
    """End of the map (pages a write transaction changed are elsewhere: :func:`check_node`)."""
    end: int
    """End of the pages LMDB wrote that the file holds (never past :attr:`map_end`)."""
    page_size: int
    max_value: int
    """Longest value the codec writes for one block."""
    pages: memoryview = memoryview(b"")
    """The written pages ``[start, end)`` as bytes (a view, nothing copied): headers are read through it."""

    @classmethod
    def of(cls, base: int | None, map_size: int, psize: int, max_value: int) -> MapWindow:
        """The window of a map of ``map_size`` bytes at ``base`` (:func:`new_mapping`), now: call it after
        beginning the transaction that reads. The pages written are read from the newer of the two meta
        pages in the map (no system call: a reading thread that released the GIL waits milliseconds for
        it under load); the file held them when it was checked at open (:mod:`kvstore.tiers.lmdb.check`).
        ``base`` unknown: an empty window (only the codec's bound is checked)."""
        if base is None:
            return cls(0, 0, 0, psize, max_value)
        metas = [_META_LAST.unpack(ctypes.string_at(base + page * psize + _META_LAST_OFFSET, _META_LAST.size))
                 for page in (0, 1)]
        last_page, _ = max(metas, key=lambda m: m[1])  # LMDB's current meta: the larger transaction id
        map_end = base + map_size
        end = min(base + (last_page + 1) * psize, map_end)
        pages = memoryview((ctypes.c_char * (end - base)).from_address(base)).cast("B")
        return cls(base, map_end, end, psize, max_value, pages)

    @property
    def known(self) -> bool:
        """Whether the map's place is known (else only the codec's bound is checked)."""
        return self.map_end > 0


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (the buffer protocol's view), to read a buffer's address without touching it."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_views = threading.local()
"""One ``Py_buffer`` per reading thread, reused (passed by reference, no argument conversion): reading an
address costs ~0.6 us this way, ~1.5 us through a numpy view."""


def address_of(buf: memoryview) -> int:
    """The address of ``buf``'s first byte (without touching it)."""
    slot = getattr(_views, "slot", None)
    if slot is None:
        view = _PyBuffer()
        slot = _views.slot = (view, ctypes.byref(view))
    view, ref = slot
    _get_buffer(ctypes.py_object(buf), ref, 0)
    addr = view.buf or 0
    _release_buffer(ref)
    return int(addr)


class Node(NamedTuple):
    """A leaf node's own account of its value: ``size`` bytes at ``addr``; ``run_pages``: the overflow run
    holding it (0: the value is inside the leaf page; -1: on overflow pages of a map whose place is unknown)."""

    size: int
    addr: int
    run_pages: int


def read_node(key: bytes, key_buf: bytes | memoryview, window: MapWindow) -> Node:
    """The node whose key LMDB returned as ``key_buf`` (a buffer into its leaf page); reads the node's
    header and, for a value on overflow pages, that run's page header when it lies in the written map.
    :class:`ValueOutOfBounds` for a page number beyond the pages written."""
    key_buf = _buffer(key_buf)
    kaddr = address_of(key_buf)
    at = kaddr - window.start
    in_map = _NODE_HEADER.size <= at and at + len(key_buf) + _PGNO.size <= len(window.pages)
    if in_map:
        lo, hi, flags, ksize = _NODE_HEADER.unpack_from(window.pages, at - _NODE_HEADER.size)
    else:  # a leaf this write transaction changed (heap memory), or a map whose place is unknown
        lo, hi, flags, ksize = _NODE_HEADER.unpack(ctypes.string_at(kaddr - _NODE_HEADER.size, _NODE_HEADER.size))
    size = lo | hi << 16
    if not flags & F_BIGDATA:
        return Node(size, kaddr + ksize, 0)
    if in_map:
        (pgno,) = _PGNO.unpack_from(window.pages, at + ksize)
    else:
        (pgno,) = _PGNO.unpack(ctypes.string_at(kaddr + ksize, _PGNO.size))
    if not window.known:
        return Node(size, 0, -1)
    first = pgno * window.page_size
    if first + window.page_size > len(window.pages):
        raise ValueOutOfBounds(key, f"its node names page {pgno}, past the {len(window.pages) // window.page_size} "
                               "pages the file holds", deletable=True)
    pflags, pages = _FLAGS_PAGES.unpack_from(window.pages, first + 10)
    if not pflags & P_OVERFLOW:
        raise ValueOutOfBounds(key, f"its node names page {pgno}, which is not an overflow page", deletable=False)
    return Node(size, window.start + first + PAGE_HEADER, pages)


def check_node(key: bytes, node: Node, window: MapWindow) -> None:
    """Raise :class:`ValueOutOfBounds` unless ``node``'s value lies where LMDB could have written it."""
    overflow = node.run_pages != 0
    if node.size > window.max_value:
        raise ValueOutOfBounds(key, f"{node.size} bytes, more than the {window.max_value} a block encodes to",
                               deletable=overflow)
    if node.run_pages < 0:
        return
    if overflow:
        if PAGE_HEADER + node.size > node.run_pages * window.page_size:
            raise ValueOutOfBounds(key, f"{node.size} bytes on a run of {node.run_pages} overflow pages", deletable=True)
        if node.addr + node.size > window.end:
            raise ValueOutOfBounds(key, f"{node.size} bytes run past the pages the file holds", deletable=True)
        return
    if not window.start <= node.addr < window.map_end:
        return  # a leaf this write transaction changed (heap memory): the length bound above is all there is
    offset = node.addr - window.start
    if (offset + node.size - 1) // window.page_size != offset // window.page_size and node.size:
        raise ValueOutOfBounds(key, f"{node.size} bytes run past the end of leaf page {offset // window.page_size}",
                               deletable=False)


def bounded_value(cursor: lmdb.Cursor, key: bytes, window: MapWindow) -> memoryview | None:
    """The value stored under ``key`` (a buffer into the map; ``cursor``'s transaction has ``buffers=True``),
    ``None`` if absent; :class:`ValueOutOfBounds` if it is not where LMDB could have written it, before
    any byte of it is touched. LMDB errors on the key's path (``lmdb.Error``) reach the caller."""
    if not cursor.set_key(key):
        return None
    check_node(key, read_node(key, cursor.key(), window), window)
    return _buffer(cursor.value())


def _buffer(got: bytes | memoryview) -> memoryview:
    """What py-lmdb returned, which must be a buffer into the map (else the checks above checked a copy)."""
    if not isinstance(got, memoryview):
        raise TypeError("LMDB values are checked in place: begin the transaction with buffers=True")
    return got


def checked_items(cursor: lmdb.Cursor, window: MapWindow) -> Iterator[tuple[bytes, memoryview | None]]:
    """Every ``(key, value)`` of ``cursor``'s database in key order, each value checked before it is touched
    (``None`` for one out of bounds, which is never touched). LMDB errors reach the caller."""
    for key_buf in cursor.iternext(values=False):
        key = bytes(key_buf)
        try:
            check_node(key, read_node(key, key_buf, window), window)
        except ValueOutOfBounds:
            yield key, None
            continue
        yield key, _buffer(cursor.value())
