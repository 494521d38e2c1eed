"""The daemon's budget of frame bytes in flight, shared by every connection.

Each connection is served one request at a time, so on its own it holds at most one request payload
and one reply, each at most ``daemon.max_frame_bytes``. Across connections that is still connections x
64 MiB: eight peers that announce a 60 MiB frame and send it slowly, or that ask for large inline replies
and never read them, made the daemon hold half a gigabyte. So every large allocation a peer causes is
first taken from one budget, ``daemon.max_inflight_bytes``::

    a request payload   taken before it is read (its length is in the header), returned when the
                        request has been handled
    a GET_INLINE reply  taken at its worst case before the blocks are read, returned once the client
                        has taken the reply (the transport's buffer drained)

A connection whose frame does not fit waits, in arrival order, with its socket unread (the client is
slowed by the socket's own flow control); after ``daemon.read_timeout_s`` it is closed with a log line
naming the limit. Only the event loop touches the budget.
"""

from __future__ import annotations

import asyncio
from collections import deque


class InflightBudget:
    """``limit`` bytes, taken by :meth:`take` and given back by :meth:`give`, first come first served."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.waited = 0
        """Frames that had to wait for room (STATS ``daemon.inflight.waited``)."""
        self.refused = 0
        """Frames that waited past their time limit (STATS ``daemon.inflight.refused``)."""
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def take(self, n: int, timeout_s: float) -> bool:
        """Take ``n`` bytes (at most :attr:`limit`), waiting up to ``timeout_s`` behind earlier takers;
        ``False`` when the time ran out (nothing taken)."""
        if n > self.limit:
            raise ValueError(f"{n} bytes can never fit a budget of {self.limit}")
        if not self._waiting and self.used + n <= self.limit:
            self.used += n
            return True
        self.waited += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiting.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
            return True
        except asyncio.TimeoutError:
            if fut.done():  # granted in the same instant the time ran out: it was taken, so keep it
                return True
            self._waiting.remove(entry)
            fut.cancel()
            self.refused += 1
            self._grant()  # a large frame that left may have blocked smaller ones behind it
            return False
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.give(n)
            elif entry in self._waiting:
                self._waiting.remove(entry)
                self._grant()
            raise

    def give(self, n: int) -> None:
        """Return ``n`` bytes taken earlier; wakes the takers that now fit, in order."""
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.used + self._waiting[0][0] <= self.limit:
            n, fut = self._waiting.popleft()
            self.used += n
            fut.set_result(None)
