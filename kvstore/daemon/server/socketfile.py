"""The daemon's Unix socket file and its shared arena's label: derive, detect a stale socket, bind privately.

A daemon killed with ``kill -9`` leaves its socket file behind (its shared
arena is a memfd the kernel frees with the process: nothing to clean up). Ownership of a socket path is a lock, not a
guess: the serving daemon holds ``<socket_path>.lock`` (:class:`SocketOwner`,
``flock``, its pid inside) from before it looks at the path until it exits,
and the kernel drops the lock when the process dies however it dies. A
starting daemon takes that lock first, so while the owner lives (even paused,
with its accept backlog full, so that a connect fails) the path is never
touched. With the lock taken, the file is removed only if nothing answers on
it; if another daemon answers, starting fails, naming it, instead of
stealing its path.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import socket
import stat
from collections.abc import Awaitable, Callable

from kvstore.errors import KVStoreError

SOCKET_MODE = 0o600


class DaemonStartError(KVStoreError):
    """The daemon cannot start: its path is taken by a live daemon, or is not a socket."""


def arena_label(socket_path: str) -> str:
    """The shared arena's label, from the absolute socket path: which daemon's memory a mapping in
    ``/proc/<pid>/maps`` is (a label only; nothing is looked up by it)."""
    digest = hashlib.blake2b(os.path.abspath(socket_path).encode(), digest_size=8).hexdigest()
    return f"kvstore-{digest}"


class SocketOwner:
    """The lock saying which daemon serves a socket path: ``<socket_path>.lock``, held while that daemon runs."""

    def __init__(self, socket_path: str) -> None:
        """Take the lock (creating the socket's directory, 0700, if new) and write this pid into it.

        Raises :class:`DaemonStartError` naming the holder's pid and the lock file
        when a live process holds it: another daemon serves ``socket_path``.
        """
        self.path = os.path.abspath(socket_path) + ".lock"
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DaemonStartError(f"another daemon is serving on {socket_path} (pid {holder} holds {self.path}); "
                                   f"stop it first, or give this one another daemon.socket_path") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: removing it could split two starters onto two inodes."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def socket_is_live(path: str, timeout_s: float = 0.5) -> bool:
    """Whether something accepts connections on the Unix socket ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
        return True
    except OSError:
        return False
    finally:
        sock.close()


def clear_stale(path: str) -> bool:
    """Remove a socket file nobody answers on.

    Call it holding the path's :class:`SocketOwner` lock: only then is a socket nobody answers on
    provably left by a daemon that is gone, not one that is alive but slow to accept.

    Raises :class:`DaemonStartError` if a daemon is live on ``path`` or ``path``
    is something other than a socket. Returns whether a stale socket was removed.
    """
    if not os.path.lexists(path):
        return False
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise DaemonStartError(f"daemon.socket_path {path} exists and is not a socket; refusing to replace it")
    if socket_is_live(path):
        raise DaemonStartError(f"another daemon is serving on {path}")
    os.unlink(path)
    return True


async def bind_private(
    path: str, start: Callable[[str], Awaitable[asyncio.AbstractServer]]
) -> asyncio.AbstractServer:
    """Create the parent directory (0700 if new) and bind ``path`` with mode 0600 from the first instant.

    The umask is narrowed while binding so the file never exists with wider
    permissions, then ``chmod`` states the mode explicitly.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    if len(os.fsencode(os.path.abspath(path))) > 107:
        raise DaemonStartError(f"daemon.socket_path {path} is longer than the 107 bytes AF_UNIX allows")
    old = os.umask(0o177)
    try:
        server = await start(path)
    finally:
        os.umask(old)
    os.chmod(path, SOCKET_MODE)
    return server
