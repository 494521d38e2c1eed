"""Walk the keys of a possibly damaged LMDB database in a child process.

LMDB checks some damage with ``assert``: a cursor stepping onto a page that is neither a leaf nor a branch
(zeroed by truncation and padding, or overwritten) calls ``abort()`` inside ``mdb_cursor_next``, which no
``except`` can catch. ``kvstore repair --salvage`` walks damaged environments by design, so the walk runs in
a child that streams each entry to the parent as it reads it: an abort ends the walk there, keeps every
entry read before it, and is reported, never taking the repair down with it.

The same child serves :func:`check_walkable`: a daemon walks its environment's databases there before
it opens them itself, so a page that would abort LMDB refuses the start with a message instead of
killing the daemon with no word (``SIGABRT`` at the first cursor step onto it).

Wire format (child stdout): per entry ``<II`` key length, value length, then the key and the value bytes.
"""

from __future__ import annotations

import signal
import struct
import subprocess
import sys
from dataclasses import dataclass

_ENTRY = struct.Struct("<II")
_CHILD = [sys.executable, "-c", "import importlib.util as u, sys; s = u.spec_from_file_location('lmdb_walk', "
           f"{__file__!r}); m = sys.modules['lmdb_walk'] = u.module_from_spec(s); s.loader.exec_module(m); m.main()"]
"""The child runs this file alone, not through the ``kvstore`` package, whose import pulls in torch: a
daemon walks its environment at every start, and the walk costs milliseconds, the package seconds."""
WALK_TIMEOUT_S = 600.0
"""Longest a walk may take (a damaged tree that loops): then the child is killed and the walk reported cut."""


@dataclass
class Walk:
    """What a walk read: ``entries`` in key order up to where it stopped; ``error`` says why it stopped early."""

    entries: list[tuple[bytes, bytes]]
    error: str | None = None


def walk(env_dir: str, map_size: int, db: str | None, *, values: bool = True,
         timeout_s: float = WALK_TIMEOUT_S) -> Walk:
    """Every ``(key, value)`` of database ``db`` (``None``: the main one) of the environment at ``env_dir``,
    opened read-only with ``map_size`` (the file must be at least that long: pad a truncated one first).
    ``values=False``: keys only (values empty). Never raises for damage: see :attr:`Walk.error`."""
    cmd = [*_CHILD, env_dir, str(map_size), db or "", "1" if values else "0"]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
        out, err, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, rc = exc.stdout or b"", exc.stderr or b"", None
    entries, pos = [], 0
    while pos + _ENTRY.size <= len(out):
        klen, vlen = _ENTRY.unpack_from(out, pos)
        end = pos + _ENTRY.size + klen + vlen
        if end > len(out):
            break  # the child died mid-entry
        key = bytes(out[pos + _ENTRY.size : pos + _ENTRY.size + klen])
        entries.append((key, bytes(out[pos + _ENTRY.size + klen : end])))
        pos = end
    what = f"database {db!r}" if db else "the main database"
    if rc is None:
        return Walk(entries, f"the walk of {what} took over {timeout_s:.0f} s and was stopped")
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        reason = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
        return Walk(entries, f"the walk of {what} stopped at a damaged page (LMDB died of {name}: {reason[0]})")
    if rc != 0:
        return Walk(entries, f"the walk of {what} stopped: {err.decode(errors='replace').strip()}")
    return Walk(entries)


def check_walkable(env_dir: str, map_size: int, dbs: dict[str, bool], timeout_s: float = WALK_TIMEOUT_S) -> str | None:
    """Walk each database of ``dbs`` (name -> read the values too) in a child; why walking one would kill the
    walking process (LMDB died of a signal, or the walk did not end), or ``None``.

    A damaged page LMDB reports as an error (``MDB_CORRUPTED``...) passes: a process meets it as an
    exception and serves its blocks as misses. Nothing is sent back but the verdict, so a large
    environment costs the walk, not a copy of it. A database that does not exist yet is fine (a new
    environment). Never raises for damage.
    """
    spec = ",".join(f"{name}:{int(values)}" for name, values in dbs.items())
    cmd = [*_CHILD, env_dir, str(map_size), spec, "check"]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"walking its databases took over {timeout_s:.0f} s (a damaged tree that loops?)"
    if done.returncode >= 0:
        return None  # walked, or stopped by an error LMDB raises (a caller survives those: counted misses)
    err = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
    rc = -done.returncode
    name = signal.Signals(rc).name if rc in signal.Signals._value2member_map_ else str(rc)
    return f"has a damaged page: LMDB died of {name} walking it ({err[0]})"


def _check(env_dir: str, map_size: int, spec: str) -> None:
    """The child of :func:`check_walkable`: walk every named database; rc 3 with the error for a refused one."""
    import lmdb

    try:
        env = lmdb.open(env_dir, readonly=True, lock=False, max_dbs=4, map_size=map_size)
        with env.begin(buffers=True) as txn:
            for item in spec.split(","):
                name, values = item.rsplit(":", 1)
                try:
                    handle = env.open_db(name.encode(), txn=txn, create=False)
                except lmdb.NotFoundError:
                    continue  # not created yet
                cursor = txn.cursor(db=handle)
                for _ in (cursor.iternext() if values == "1" else cursor.iternext(values=False)):
                    pass
    except lmdb.Error as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(3)


def main() -> None:
    """The child: ``env_dir map_size db values``; entries to stdout, a damaged page's error to stderr, rc 3.

    ``env_dir map_size name:values,... check``: :func:`check_walkable`'s walk, nothing on stdout."""
    import lmdb

    if len(sys.argv) > 4 and sys.argv[4] == "check":
        _check(sys.argv[1], int(sys.argv[2]), sys.argv[3])
        return
    env_dir, map_size, db, values = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    out = sys.stdout.buffer
    try:
        env = lmdb.open(env_dir, readonly=True, lock=False, max_dbs=4, map_size=map_size)
        with env.begin(buffers=True) as txn:
            handle = env.open_db(db.encode(), txn=txn, create=False) if db else None
            cursor = txn.cursor(db=handle)
            items = cursor.iternext() if values else ((k, b"") for k in cursor.iternext(values=False))
            for key, value in items:
                out.write(_ENTRY.pack(len(key), len(value)) + bytes(key) + bytes(value))
                out.flush()  # each entry reaches the parent before the next page is touched
    except lmdb.Error as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(3)
