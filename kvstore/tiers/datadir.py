"""A tier's data directory: owner-only permissions, and one process at a time.

Cached blocks are the prompts and KV state of every tenant, so nothing a tier
writes may be readable by other local users: directories are created 0700,
files 0600, and a data directory or file found wider (an older build, a
permissive umask) is narrowed when a tier opens it.

Two processes writing one directory corrupt each other's accounting (two LRU
orders, two capacity counts over one LMDB map or one file tree). A tier
therefore holds an exclusive ``flock`` on ``<dir>/kvstore.lock`` for its whole
life; the lock file records the holder's pid so the second process can say
whom it lost to. The kernel drops the lock when the holder exits, even by
``kill -9``, so a stale lock file never blocks a restart (its content is then
simply overwritten).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat

from kvstore.errors import TierError

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
LOCK_NAME = "kvstore.lock"


def make_private_dir(path: str) -> None:
    """Create ``path`` and any missing parents with mode 0700; narrow ``path`` itself to 0700 if it is wider.

    Parents that already exist are left alone (they may be shared, like ``/var/lib``).
    Raises :class:`TierError` naming the path if it cannot be created or is not a directory.
    """
    path = os.path.abspath(path)
    missing: list[str] = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d, DIR_MODE)  # the umask can only narrow it
            except FileExistsError:
                pass  # created concurrently
        if not os.path.isdir(path):
            raise TierError(f"data directory {path} exists and is not a directory; remove it or choose another path")
        narrow(path, DIR_MODE)
    except OSError as exc:
        raise TierError(f"cannot create data directory {path}: {exc.strerror or exc}") from None


def narrow(path: str, mode: int) -> None:
    """``chmod`` ``path`` to ``mode`` if it grants anything outside ``mode`` (logged); a no-op otherwise."""
    current = stat.S_IMODE(os.stat(path).st_mode)
    if current & ~mode:
        os.chmod(path, current & mode)
        log.warning("narrowed permissions of %s from %o to %o (kvstore data is owner-only)", path, current, current & mode)


def describe_process(pid: int | None) -> str:
    """``pid 123 (python -m kvstore serve ...)``: whatever of the process this host can tell."""
    if pid is None:
        return "a process whose pid is not recorded"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    return f"pid {pid} ({cmd[:200]})" if cmd else f"pid {pid}"


def flock_holder(fd: int) -> int | None:
    """Pid holding a ``flock`` on the file open as ``fd``, from ``/proc/locks`` (``None`` if not found)."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
                    continue
                if fields[5] == ident:
                    return int(fields[4])
    except (OSError, ValueError):
        pass
    return None


class DirLock:
    """An exclusive ``flock`` on ``<directory>/kvstore.lock``, held until :meth:`release` or process exit."""

    def __init__(self, directory: str, setting: str) -> None:
        """Take the lock; :class:`TierError` naming the holder if another process has it.

        ``setting`` names the config field that chose ``directory`` (``disk.path``), for the message.
        """
        self.path = os.path.join(directory, LOCK_NAME)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            raise TierError(f"cannot create the lock file {self.path}: {exc.strerror or exc} "
                            f"(is {setting} {directory} writable by this user?)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = self._recorded_pid(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise TierError(f"cannot lock {self.path}: {exc.strerror or exc}") from None
            raise TierError(
                f"{setting} {os.path.abspath(directory)} is in use by another kvstore process, "
                f"{describe_process(holder)}; two processes must not share one data directory: stop that one, "
                f"or give this one another {setting} (to use a running daemon's cache instead, connect to it with "
                "`connector: sidecar`)"
            ) from None
        narrow(self.path, FILE_MODE)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    @staticmethod
    def _recorded_pid(fd: int) -> int | None:
        try:
            text = os.pread(fd, 64, 0).decode(errors="replace").strip()
            return int(text) if text else flock_holder(fd)
        except (OSError, ValueError):
            return flock_holder(fd)

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race with the next process taking it). Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
