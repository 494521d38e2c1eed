"""The process at the other end of a Unix connection, so the daemon can tell a dead client from a silent one.

At accept, ``SO_PEERCRED`` names the pid that connected. A pidfd
(``os.pidfd_open``) then refers to that very process, so a recycled pid can
never be mistaken for it; it becomes readable when the process exits. Where
pidfds are missing (Linux before 5.3) the process's start time in
``/proc/<pid>/stat`` plays the same part, polled.

A TCP peer, or a Unix peer whose pid is not visible from the daemon's pid
namespace (``SO_PEERCRED`` says 0), has no :class:`PeerProcess`: its holds
end at their deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select

POLL_S = 0.1
"""Poll period where no pidfd is available."""


def _start_time(pid: int) -> int | None:
    """Field 22 (start time, clock ticks after boot) of ``/proc/<pid>/stat``; ``None`` if the process is gone
    or a zombie (it runs no more code)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # the command name may contain spaces and parentheses
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


class PeerProcess:
    """One client process, identified at connect time. :meth:`close` it when done."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd: int | None = None
        self._start = _start_time(pid)
        with contextlib.suppress(OSError, AttributeError):  # no pidfd: fall back to the start time
            self._pidfd = os.pidfd_open(pid)
        self._gone_at_open = self._start is None

    @classmethod
    def of_peer(cls, pid: int | None) -> PeerProcess | None:
        """The process behind a Unix peer's ``SO_PEERCRED`` pid (read once, at accept, by
        :func:`kvstore.daemon.server.admission.peer_of`); ``None`` for TCP or a pid not visible here (0)."""
        return cls(pid) if pid else None

    def gone(self) -> bool:
        """Whether the process has exited (it can no longer touch shared memory). Changes nothing."""
        if self._gone_at_open:
            return True
        if self._pidfd is not None:
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            return bool(poller.poll(0))
        return _start_time(self.pid) != self._start

    async def wait_gone(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the process to exit; returns whether it did."""
        if self.gone():
            return True
        loop = asyncio.get_running_loop()
        if self._pidfd is None:
            deadline = loop.time() + timeout_s
            while loop.time() < deadline:
                await asyncio.sleep(min(POLL_S, max(0.0, deadline - loop.time())))
                if self.gone():
                    return True
            return False
        exited: asyncio.Future[bool] = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(True)

        loop.add_reader(self._pidfd, on_exit)
        try:
            return await asyncio.wait_for(exited, timeout_s)
        except asyncio.TimeoutError:
            return False
        finally:
            loop.remove_reader(self._pidfd)

    def close(self) -> None:
        """Release the pidfd."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
