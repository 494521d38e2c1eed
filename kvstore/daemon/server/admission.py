"""Who may hold a connection: the peer of a socket, connection caps, and the failed-login lockout.

A *peer* is the unit limits apply to: one IP address over TCP, one user id
over the Unix socket (from ``SO_PEERCRED``). Two plain ledgers:

- :class:`ConnectionLimits`: open connections in all and per peer. TCP may use
  at most 7/8 of the total, so a remote flood always leaves room for local clients.
- :class:`LoginThrottle`: failed logins per peer within a window; a peer past
  the limit is refused until its oldest counted failure leaves the window.

Both are touched only from the event loop thread.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Transport = Literal["unix", "tcp"]
_PEERCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Peer:
    """The far end of a connection. ``ident`` is what limits count by (``tcp:IP`` or ``uid:N``)."""

    transport: Transport
    ident: str
    pid: int | None
    """The peer process (Unix socket only, from ``SO_PEERCRED``)."""


def peer_of(writer: asyncio.StreamWriter, transport: Transport) -> Peer:
    """The peer of an accepted connection (``uid:?`` when the kernel does not say)."""
    sock = writer.get_extra_info("socket")
    if transport == "tcp":
        addr = writer.get_extra_info("peername")
        return Peer("tcp", f"tcp:{addr[0] if addr else '?'}", None)
    try:
        pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except (OSError, AttributeError):
        return Peer("unix", "uid:?", None)
    return Peer("unix", f"uid:{uid}", pid)


class ConnectionLimits:
    """Counts open connections; :meth:`admit` says whether one more may open (and records it)."""

    def __init__(self, max_total: int, max_per_peer: int) -> None:
        self.max_total, self.max_per_peer = max_total, max_per_peer
        self.max_tcp = max_total - max(1, max_total // 8)
        self.total = 0
        self.tcp = 0
        self._per_peer: dict[str, int] = {}
        self.refused = 0
        """Connections refused by a cap (a counter for stats)."""

    def admit(self, peer: Peer) -> str | None:
        """Record a new connection of ``peer`` and return ``None``, or return why it is refused (records nothing)."""
        why = None
        if self.total >= self.max_total:
            why = f"the daemon has {self.total} connections, its limit (daemon.max_connections)"
        elif peer.transport == "tcp" and self.tcp >= self.max_tcp:
            why = f"the daemon has {self.tcp} TCP connections, the most TCP may use of daemon.max_connections {self.max_total}"
        elif self._per_peer.get(peer.ident, 0) >= self.max_per_peer:
            why = f"peer {peer.ident} has {self.max_per_peer} connections, its limit (daemon.max_connections_per_peer)"
        if why is not None:
            self.refused += 1
            return why
        self.total += 1
        self.tcp += peer.transport == "tcp"
        self._per_peer[peer.ident] = self._per_peer.get(peer.ident, 0) + 1
        return None

    def leave(self, peer: Peer) -> None:
        """Forget one admitted connection of ``peer``."""
        self.total -= 1
        self.tcp -= peer.transport == "tcp"
        left = self._per_peer[peer.ident] - 1
        if left:
            self._per_peer[peer.ident] = left
        else:
            del self._per_peer[peer.ident]


class LoginThrottle:
    """Failed logins per peer in a sliding window of ``window_s``; ``max_failures`` in it lock the peer out."""

    def __init__(self, max_failures: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_failures, self.window_s, self._clock = max_failures, window_s, clock
        self._failures: dict[str, deque[float]] = {}

    def failed(self, peer: Peer) -> None:
        """Count one failed login of ``peer``."""
        q = self._failures.setdefault(peer.ident, deque())
        q.append(self._clock())
        while len(q) > self.max_failures:
            q.popleft()

    def locked_for(self, peer: Peer) -> float:
        """Seconds ``peer`` is still refused (0.0: it may try to log in)."""
        q = self._failures.get(peer.ident)
        if not q:
            return 0.0
        now = self._clock()
        while q and now - q[0] >= self.window_s:
            q.popleft()
        if not q:
            del self._failures[peer.ident]
            return 0.0
        return self.window_s - (now - q[0]) if len(q) >= self.max_failures else 0.0
