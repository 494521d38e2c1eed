"""An LMDB environment checked before it is mapped, and LMDB errors as kvstore errors naming the file.

LMDB maps ``data.mdb`` and trusts it: a page it reaches past the end of a
truncated file is a ``SIGBUS`` that kills the process with no message. So
before :func:`lmdb.open` the two meta pages are read with plain ``read``
calls and the file size is compared with what they promise::

    page 0, page 1 (meta)   offset 16 in the page: uint32 magic 0xBEEFC0DE, uint32 version
                            offset 40: uint32 page size (the free DB's md_pad)
                            offset 136: uint64 last page number, offset 144: uint64 txn id

LMDB uses the meta page with the larger transaction id; the file must hold
``(last page + 1) * page size`` bytes. A shorter file, a file that is not an
LMDB environment, or an error from LMDB itself becomes :class:`TierError`
whose message names the file and the way out: ``kvstore repair``, which moves
the damaged environment aside (kept for inspection) and starts an empty one.
"""

from __future__ import annotations

import os
import stat
import struct

from kvstore.errors import DamagedData, TierError

META_MAGIC = 0xBEEFC0DE
_META = struct.Struct("<II")  # magic, version at offset 16 of a meta page
_META_OFFSET = 16
_PSIZE_OFFSET = 40
_LAST = struct.Struct("<QQ")  # last page number, txn id at offset 136
_LAST_OFFSET = 136
_META_BYTES = _LAST_OFFSET + _LAST.size
DATA_FILE = "data.mdb"


def repair_hint(path: str) -> str:
    """What to do about a damaged environment at ``path`` (appended to every damage message)."""
    layout = (f" --layout {os.path.basename(os.path.normpath(path))}"  # one layout's of a daemon serving any
              if os.path.basename(os.path.dirname(os.path.normpath(path))) == "layouts" else "")
    return (f"to keep the damaged files for inspection and start with an empty cache, stop every kvstore process "
            f"using it and run `kvstore repair --config <your config>{layout}` (moves {path} aside to "
            f"{path}.damaged-<time>; add --salvage to copy the blocks that still verify into the new environment)")


def damaged(path: str, what: str, hint: str | None = None) -> DamagedData:
    """:class:`~kvstore.errors.DamagedData` saying ``what`` is wrong with the environment at ``path``, with ``hint`` (default: the
    ``kvstore repair`` hint of the LMDB tier)."""
    return DamagedData(f"LMDB environment {os.path.join(path, DATA_FILE)} {what}; {hint or repair_hint(path)}")


def expected_size(data_file: str, hint: str | None = None) -> int | None:
    """Bytes ``data_file`` must have according to its newest meta page (``None``: empty or absent, a new
    environment; the opener says so when the file was there but empty).

    Raises :class:`TierError` (via :func:`damaged`, with ``hint``) if it is not an LMDB data file: not a
    regular file (a directory in its place) or without valid meta pages."""
    path = os.path.dirname(data_file)
    try:
        fd = os.open(data_file, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise damaged(path, hint=hint, what=f"cannot be read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise damaged(path, hint=hint, what=f"is {kind}, not LMDB's data file")
        size = st.st_size
        if size == 0:
            return None
        first = os.pread(fd, _META_BYTES, 0)
        if len(first) < _META_BYTES or _META.unpack_from(first, _META_OFFSET)[0] != META_MAGIC:
            raise damaged(path, hint=hint, what=f"is not an LMDB data file ({size} bytes, no LMDB meta page at the start)")
        psize = struct.unpack_from("<I", first, _PSIZE_OFFSET)[0]
        if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
            raise damaged(path, hint=hint, what=f"has a damaged meta page (page size {psize})")
        second = os.pread(fd, _META_BYTES, psize)
        if len(second) < _META_BYTES:
            raise damaged(path, hint=hint, what=f"is truncated: {size} bytes, shorter than its two meta pages ({2 * psize} bytes)")
        if _META.unpack_from(second, _META_OFFSET)[0] != META_MAGIC:
            raise damaged(path, hint=hint, what="has a damaged second meta page (bad magic)")
        metas = [_LAST.unpack_from(page, _LAST_OFFSET) for page in (first, second)]
        last_page, _ = max(metas, key=lambda m: m[1])  # LMDB picks the meta with the larger txn id
        return (last_page + 1) * psize
    finally:
        os.close(fd)


def check_environment(path: str, hint: str | None = None) -> None:
    """Refuse (``TierError``) an environment directory whose ``data.mdb`` is not LMDB or is shorter than its
    meta pages say; mapping such a file would fault (``SIGBUS``) on the first page past its end. ``hint``: what to do,
in the message (default: ``kvstore repair``). Changes nothing."""
    data_file = os.path.join(path, DATA_FILE)
    need = expected_size(data_file, hint)
    if need is None:
        return
    size = os.path.getsize(data_file)
    if size < need:
        raise damaged(path, f"is truncated: {size} bytes, its meta page says {need}", hint)


def check_walkable_databases(path: str, hint: str | None = None) -> None:
    """Refuse (``TierError``) an environment whose databases LMDB cannot walk without dying.

    LMDB meets some damage (a zeroed or overwritten leaf or branch page) with ``abort()`` inside a
    cursor step, which no ``except`` catches; the walk runs in a child process
    (:func:`kvstore.tiers.lmdb.walk.check_walkable`: the keys of both databases, every leaf and branch
    page stepped on, no value touched: a damaged node size is the serving process's to check,
    :mod:`kvstore.tiers.lmdb.value`, and must not refuse the start), so the caller gets a message naming the file and
    ``kvstore repair`` instead. A new (absent or empty) environment passes. Call it before opening the
    environment in a process that must not die of it (the daemon).
    """
    from kvstore.tiers.lmdb.walk import check_walkable

    check_environment(path, hint)
    data_file = os.path.join(path, DATA_FILE)
    size = os.path.getsize(data_file) if os.path.isfile(data_file) else 0
    if size:
        why = check_walkable(path, size, {"lru": False, "blocks": False})
        if why is not None:
            raise damaged(path, why, hint)

