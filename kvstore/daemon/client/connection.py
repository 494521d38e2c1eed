"""Blocking, thread-safe client of the daemon: connection, handshake, requests, reconnection.

One file past 500 lines, on purpose: every part of :class:`DaemonClient` (connect and login, reconnection
with backoff, per-thread deadlines, the breaker's probe, the deferred quiet frames) works on the same socket
under the same lock and the same per-thread deadline; apart, each part would take the others' socket, lock and
deadline back as arguments.

One socket (Unix or TCP), one request in flight at a time under :attr:`lock`
(an ``RLock``, so a caller can hold it across several requests that must
see the same connection, such as GET_SHM, copy, RELEASE). A get's release is
deferred (:meth:`DaemonClient.defer_release`): it rides in the next GET_SHM's
frame (GET_SHM_RELEASE), goes out as a RELEASE_QUIET in the same ``send`` as
any other request, or alone after :data:`QUIET_DELAY_S`. When the daemon
goes away the next request fails with :class:`DaemonUnavailable`; later
requests reconnect, no sooner than an exponential backoff allows (so a dead
daemon costs a caller one failed ``connect``, not a hang). Every successful
(re)connection increments :attr:`generation` and re-attaches the shared
memory: slots and holds from an older generation mean nothing.

Deadlines: a daemon that stops answering (paused, swapping, a stuck disk
under it) is worse than one that dies, so no call waits on it longer than
its deadline. :meth:`DaemonClient.within` sets one for every request the
calling thread makes inside it (waiting for the connection's lock included);
a request past it raises :class:`DeadlineMissed` and drops the connection,
so a late reply is never read as the answer to a later request. With a
:class:`~kvstore.util.breaker.CircuitBreaker` (``breaker=``), repeated misses
make every call a fast :class:`BreakerOpen` until a background probe finds
the daemon answering again.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvstore.util.breaker import BreakerSettings, CircuitBreaker, MissReason
from kvstore.daemon.wire import messages as m
from kvstore.daemon.wire.auth import login_proof
from kvstore.daemon.wire.frames import (
    ARENA_BYTE, HEADER_SIZE, MAX_KEYS, MAX_NAME_BYTES, MAX_REPLY_BYTES, OBSERVER_FINGERPRINT, REPLY_BIT, DaemonError, ErrorCode, Op, ProtocolError, decode_header,
    encode_frame,
)
from kvstore.daemon.wire.layout_check import LayoutMismatch, decode_bad_layout
from kvstore.errors import KVStoreError, NotDurable
from kvstore.layout import KVLayout

if TYPE_CHECKING:  # imported where a shared arena is attached: it needs torch, which `kvstore stats` must not load
    from kvstore.tiers.host.arena import HostArena
    from kvstore.tiers.host.slot_directory import DirectoryReader

log = logging.getLogger(__name__)

IDLE_CHECK_S = 1.0
"""A connection unused this long is checked for a close by the daemon (idle timeout) before reuse."""
QUIET_DELAY_S = 0.002
"""Longest a deferred release (:meth:`DaemonClient.defer_release`) waits for the next request to travel with."""
QUIET_SEND_S = 0.5
"""Deadline of the background send of deferred releases (the daemon ends unsent holds at their deadline)."""


class DaemonUnavailable(KVStoreError):
    """No daemon answers at the configured address (now, or within the backoff window)."""

    reason = MissReason.GONE


class DeadlineMissed(DaemonUnavailable):
    """The daemon did not answer within the call's deadline (:meth:`DaemonClient.within`); the connection was
    dropped, so its late reply is never read."""

    reason = MissReason.DEADLINE


class BreakerOpen(DaemonUnavailable):
    """Not asked: the client's breaker is open after repeated misses (a background probe closes it)."""

    reason = MissReason.BREAKER_OPEN


class DaemonClient:
    """Speaks the daemon protocol for one engine process (``layout=None``: an observer that may only ask STATS)."""

    def __init__(
        self,
        layout: KVLayout | None,
        *,
        socket_path: str | None = None,
        tcp: tuple[str, int] | None = None,
        token: str | None = None,
        client_name: str = "",
        use_shm: bool = True,
        read_directory: bool = True,
        prefault: bool = True,
        timeout_s: float = 60.0,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        breaker: BreakerSettings | None = None,
        probe_timeout_s: float = 1.0,
    ) -> None:
        if (socket_path is None) == (tcp is None):
            raise ValueError("give exactly one of socket_path and tcp")
        self.layout = layout
        # The name as the daemon will decode it (the proof covers it, so both sides must agree).
        client_name = client_name.encode()[:MAX_NAME_BYTES].decode("utf-8", "ignore")
        self.socket_path, self.tcp, self.token, self.client_name = socket_path, tcp, token, client_name
        self.use_shm = use_shm and socket_path is not None
        self.read_directory = read_directory
        """Look up host-resident keys in the daemon's slot directory and copy them without a GET_SHM
        (:attr:`directory`); ``False``: every get asks the daemon."""
        self.prefault = prefault
        """Map this process's view of the shared segment ahead, on a background thread, at each attach
        (:mod:`kvstore.tiers.host.prefault`), so its first copy into each slot takes no page faults."""
        self.timeout_s = timeout_s
        """Deadline of a request made outside any :meth:`within`."""
        self.probe_timeout_s = probe_timeout_s
        """Deadline of the breaker's background probe (connect, login and one empty EXISTS_PREFIX)."""
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.lock = threading.RLock()
        self.hello: m.HelloReply | None = None
        self.arena: HostArena | None = None
        self.directory: DirectoryReader | None = None
        """The daemon's slot directory in the shared segment (``None``: none offered, not wanted, or a machine
        whose memory order does not make its seqlock read sound)."""
        self.generation = 0
        self.round_trips = 0
        """Request/reply exchanges sent on any connection so far (login included; frames that get no reply, such
        as RELEASE_QUIET, are not counted): what a caller's batching saves is measured in these, each one a wake-up
        of the daemon's loop and of this thread."""
        self._sock: socket.socket | None = None
        self._next_id = 0
        self._backoff = backoff_initial_s
        self._next_attempt = 0.0
        self._last_used = 0.0
        self._quiet: list[bytes] = []
        """Keys whose read holds :meth:`defer_release` deferred: released ahead of the next request on this connection."""
        self._touched: list[bytes] = []
        """Keys read through the directory that :meth:`defer_touch` has not reported yet (TOUCH_QUIET)."""
        self._quiet_since = 0.0
        self._quiet_wake = threading.Event()
        self._flusher: tuple[threading.Thread, threading.Event] | None = None
        self._login_timed_out = False
        """The last failed (re)connection was a deadline passed (a paused daemon), not a refusal (a dead one)."""
        self._scope = threading.local()
        """Per thread: ``deadline``, the monotonic time the thread's requests give up at (:meth:`within`)."""
        self.breaker = CircuitBreaker(self.address, breaker, self._probe) if breaker is not None else None
        """Opens after repeated misses (``None``: no breaker, every call asks)."""

    @property
    def max_keys(self) -> int:
        """Most keys the daemon takes in one request (what it said at login; :data:`MAX_KEYS` before)."""
        return self.hello.max_keys if self.hello is not None else MAX_KEYS

    @property
    def address(self) -> str:
        """``unix:PATH`` or ``tcp:HOST:PORT``."""
        return f"unix:{self.socket_path}" if self.socket_path else f"tcp:{self.tcp[0]}:{self.tcp[1]}"  # type: ignore[index]

    def _where_hint(self, exc: BaseException) -> str:
        """For a Unix socket that is not there (or has no listener): where that is, and why it may differ
        from where the daemon listens (a relative path resolves against each process's directory)."""
        if self.socket_path is None or not isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
            return ""
        here = os.path.abspath(self.socket_path)
        hint = f" (looked for {here}; is `kvstore serve` running"
        if not os.path.isabs(self.socket_path):
            hint += (f"? the socket path {self.socket_path!r} is relative, so it depends on the directory a process "
                     "starts in: run from the daemon's directory, or give daemon.socket_path as an absolute path "
                     "(--socket, KVSTORE_DAEMON__SOCKET_PATH)")
        else:
            hint += " with this daemon.socket_path?"
        return hint + ")"

    # ---------------------------------------------------------- deadlines
    @contextmanager
    def within(self, seconds: float) -> Iterator[None]:
        """Every request this thread makes inside gives up ``seconds`` from now (or at an enclosing deadline, if
        sooner), raising :class:`DeadlineMissed`: the wait for the connection's lock, connecting and logging in,
        sending and each read of the reply."""
        outer = getattr(self._scope, "deadline", None)
        mine = time.monotonic() + max(0.0, seconds)
        self._scope.deadline = mine if outer is None else min(outer, mine)
        try:
            yield
        finally:
            self._scope.deadline = outer

    def _remaining(self, what: str) -> float:
        """Seconds left to this thread's deadline (:attr:`timeout_s` outside :meth:`within`); raises
        :class:`DeadlineMissed` naming ``what`` when none are."""
        deadline = getattr(self._scope, "deadline", None)
        if deadline is None:
            return self.timeout_s
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineMissed(f"the daemon at {self.address} did not answer {what} within the call's deadline")
        return left

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the connection's lock (:attr:`lock`), waiting no longer than this thread's deadline; refused at once
        (:class:`BreakerOpen`) while the breaker is open. Raises :class:`DeadlineMissed` when another call holds
        the connection past the deadline (it is waiting on a daemon that does not answer)."""
        if self.breaker is not None and not self.breaker.allow():
            raise BreakerOpen(f"the daemon at {self.address} missed its deadlines; not asked until it answers again")
        if not self.lock.acquire(timeout=self._remaining("(waiting for the connection)")):
            raise self._missed(DeadlineMissed(f"the connection to the daemon at {self.address} stayed busy with "
                                              f"another call past this call's deadline"))
        try:
            yield
        finally:
            self.lock.release()

    def _missed(self, exc: DaemonUnavailable) -> DaemonUnavailable:
        """``exc``, counted by the breaker (not while it is open: then only its probe asks)."""
        if self.breaker is not None and not self.breaker.is_open:
            self.breaker.failed(exc.reason, str(exc))
        return exc

    def _answered(self) -> None:
        if self.breaker is not None:
            self.breaker.succeeded()

    def _probe(self) -> None:
        """The breaker's probe: connect if needed, log in and ask an empty EXISTS_PREFIX within
        :attr:`probe_timeout_s`; raises when the daemon does not answer."""
        with self.within(self.probe_timeout_s):
            if not self.lock.acquire(timeout=self.probe_timeout_s):
                raise DeadlineMissed("the connection stayed busy")
            try:
                self._next_attempt = 0.0
                self._ensure()
                self._request_locked(Op.EXISTS_PREFIX, m.encode_keys([]))
            finally:
                self.lock.release()

    # -------------------------------------------------------- connection
    def connect(self, wait_s: float = 0.0) -> m.HelloReply:
        """Connect and handshake, retrying with backoff for up to ``wait_s`` seconds.

        Raises :class:`DaemonUnavailable` when nothing answers in time, and
        :class:`DaemonError` at once when the daemon refuses the handshake.
        """
        deadline = time.monotonic() + wait_s
        while True:
            with self.lock, self.within(max(deadline - time.monotonic(), self.probe_timeout_s)):
                self._next_attempt = 0.0
                try:
                    return self._ensure()
                except DaemonUnavailable:
                    if time.monotonic() >= deadline:
                        raise
                    delay = self._backoff
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))

    def ensure(self) -> m.HelloReply:
        """The current handshake, connecting first if needed (but not before the backoff allows).

        Raises :class:`DaemonUnavailable` or, for a refused handshake, :class:`DaemonError`.
        """
        with self.locked():
            return self._ensure()

    def close(self) -> None:
        """Close the connection and detach the shared memory (the daemon's holds end at their deadlines)."""
        if self.breaker is not None:
            self.breaker.close()
        with self.lock:
            self.send_deferred()
            self._drop()
            self._detach()
            flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher[1].set()
            self._quiet_wake.set()
            flusher[0].join(1.0)

    def _ensure(self) -> m.HelloReply:
        if self._sock is not None and self.hello is not None:
            if time.monotonic() - self._last_used < IDLE_CHECK_S or not self._closed_by_daemon():
                return self.hello
            log.info("the daemon at %s closed the idle connection; reconnecting", self.address)
            self._drop()
        now = time.monotonic()
        if now < self._next_attempt:
            wait = f"next reconnect in {self._next_attempt - now:.2f} s"
            if self._login_timed_out:  # paused, not gone: it accepted but did not answer the last login in time
                raise self._missed(DeadlineMissed(f"the daemon at {self.address} did not answer the last login in "
                                                  f"time; {wait}"))
            raise self._missed(DaemonUnavailable(f"daemon at {self.address} is down; {wait}"))
        try:
            self._sock = self._open()
            proof = None
            if self.token:  # challenge-response: the token itself never crosses the wire
                nonce = m.decode_challenge(self._roundtrip(Op.CHALLENGE, b""))
                transport = "unix" if self.socket_path is not None else "tcp"
                proof = login_proof(self.token, nonce, transport, self._fingerprint(), self.use_shm, self.client_name)
            payload = m.encode_hello(m.Hello(self._fingerprint(), proof, self.client_name, self.use_shm, self.layout))
            hello = m.decode_hello_reply(self._roundtrip(Op.HELLO, payload))
            arena_fd = self._receive_arena() if hello.shm_name is not None else None
        except (OSError, ProtocolError, DaemonError, DeadlineMissed) as exc:
            self._drop()
            if isinstance(exc, ProtocolError) and exc.code == ErrorCode.BAD_VERSION:  # retrying cannot help either
                raise DaemonError(ErrorCode.BAD_VERSION, f"the daemon at {self.address} speaks another protocol: "
                                  f"{exc.message}") from None
            if isinstance(exc, DaemonError) and exc.code != ErrorCode.UNAVAILABLE:
                raise self._refusal(exc) from None  # a refused login: retrying cannot help
            self._next_attempt = time.monotonic() + self._backoff  # unreachable, or refused for now (a cap)
            self._backoff = min(self._backoff * 2, self.backoff_max_s)
            self._login_timed_out = isinstance(exc, (DeadlineMissed, TimeoutError))
            if self._login_timed_out:
                raise self._missed(DeadlineMissed(f"the daemon at {self.address} did not complete the login within "
                                                  f"the call's deadline")) from None
            raise self._missed(DaemonUnavailable(f"cannot reach the daemon at {self.address}: "
                                                 f"{exc}{self._where_hint(exc)}")) from None
        self._detach()
        if arena_fd is not None:
            try:
                self._attach(hello, arena_fd)
            except KVStoreError as exc:  # an arena another process could shrink (or too small): never mapped
                self._drop()
                raise DaemonError(ErrorCode.BAD_FRAME, f"the daemon at {self.address} passed an unusable shared "
                                  f"arena: {exc}") from None
        self.hello = hello
        self.generation += 1
        self._backoff = self.backoff_initial_s
        log.info("connected to the daemon at %s (generation %d, shm %s)", self.address, self.generation, hello.shm_name)
        return hello

    def _receive_arena(self) -> int:
        """The shared arena's descriptor, which the daemon sends right after a HELLO reply granting it: one
        :data:`ARENA_BYTE` carrying it as ``SCM_RIGHTS``. Raises ``ProtocolError`` (closing any stray
        descriptors) when something else comes."""
        assert self._sock is not None
        self._sock.settimeout(self._remaining("HELLO (the arena's descriptor)"))
        data, fds, flags, _ = socket.recv_fds(self._sock, 1, 4)
        if data == ARENA_BYTE and len(fds) == 1 and not flags & socket.MSG_CTRUNC:
            return fds[0]
        for fd in fds:
            os.close(fd)
        raise ProtocolError(ErrorCode.BAD_FRAME, f"HELLO: expected the arena's descriptor after the reply, got "
                            f"{data!r} with {len(fds)} descriptors")

    def _attach(self, hello: m.HelloReply, fd: int) -> None:
        """Map the daemon's shared arena from ``fd`` (taken over), and its slot directory where one is there and usable."""
        from kvstore.tiers.host.arena import HostArena
        from kvstore.tiers.host.slot_directory import DirectoryReader, reads_supported

        assert hello.shm_name is not None
        self.arena = HostArena.attach(fd, hello.shm_name, hello.bytes_per_block, num_slots=hello.num_slots)
        if self.prefault and not hello.sparse:  # a sparse arena's pages are allocated by use, not ahead
            self.arena.prefault("daemon client")  # this process's page table for the segment, in the background
        if self.read_directory and reads_supported() and self.arena.tail is not None:
            self.directory = DirectoryReader.attach(self.arena.tail.numpy(), hello.num_slots)
            if self.directory is None:
                log.info("the daemon's shared arena carries no usable slot directory: every get asks the daemon")

    def _detach(self) -> None:
        self.directory = None  # its arrays map the segment: dropped before the arena unmaps it
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def _refusal(self, exc: DaemonError) -> DaemonError:
        """What a refused login raises: a refused layout becomes a :class:`LayoutMismatch` naming each field."""
        if exc.code == ErrorCode.BAD_LAYOUT and self.layout is not None:
            decoded = decode_bad_layout(exc.message)
            if decoded is not None:
                return LayoutMismatch(self.layout, decoded[0], decoded[1], self.address)
        return exc

    def _closed_by_daemon(self) -> bool:
        """Whether the daemon closed the socket (readable with nothing to read). Changes nothing.

        ``poll``, not ``select``: ``select`` refuses a descriptor numbered 1024 or above
        (``FD_SETSIZE``), and inference servers routinely hold more open files than that.
        """
        assert self._sock is not None
        try:
            poller = select.poll()
            poller.register(self._sock, select.POLLIN)
            return bool(poller.poll(0)) and self._sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _fingerprint(self) -> bytes:
        return OBSERVER_FINGERPRINT if self.layout is None else self.layout.fingerprint

    def _open(self) -> socket.socket:
        if self.socket_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: str | tuple[str, int] = self.socket_path
        else:
            assert self.tcp is not None
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            target = self.tcp
        try:
            sock.settimeout(self._remaining("connect"))
            sock.connect(target)
        except (OSError, DeadlineMissed):
            sock.close()
            raise
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self.hello = None
        self._quiet.clear()  # they were for this connection: its holds end with it (deadline or process exit)
        self._touched.clear()  # uses of blocks of a daemon that may be gone: not worth a reconnect

    # ----------------------------------------------------------- requests
    def request(self, op: Op, payload: bytes = b"") -> bytes:
        """Send one request and return the reply payload.

        Raises :class:`DaemonError` for an error reply (the connection stays
        usable unless the error was fatal) and :class:`DaemonUnavailable` when
        the connection breaks (the request may or may not have been executed).
        """
        with self.locked():
            self._ensure()
            return self._request_locked(op, payload)

    def _request_locked(self, op: Op, payload: bytes) -> bytes:
        """:meth:`request` with the lock held and connected."""
        try:
            body = self._roundtrip(op, payload)
        except (OSError, ProtocolError, DeadlineMissed) as exc:
            self._drop()
            self._next_attempt = 0.0  # the first reconnect after a break is immediate
            if isinstance(exc, (DeadlineMissed, TimeoutError)):
                raise self._missed(DeadlineMissed(f"the daemon at {self.address} did not answer {op.name} within "
                                                  f"the call's deadline; the connection is dropped")) from None
            raise self._missed(DaemonUnavailable(f"connection to the daemon at {self.address} broke during "
                                                 f"{op.name}: {exc}")) from None
        self._answered()
        return body

    def send_quiet(self, op: Op, payload: bytes = b"") -> None:
        """Send a request that has no reply (``RELEASE_QUIET``) now; the daemon executes it before anything sent
        later on this connection. Raises :class:`DaemonUnavailable` when the connection breaks."""
        with self.locked():
            self._ensure()
            self._send_frames(op, [encode_frame(op, self._new_id(), payload)])

    def release_now(self, keys: Sequence[bytes]) -> None:
        """End this connection's holds on ``keys`` (reservations included) with a RELEASE_QUIET sent now, whatever
        the caller's deadline or the breaker: the clean-up of a call that gave up midway. Best effort, within
        :data:`QUIET_SEND_S`; never raises (unsent, the daemon ends the holds at their deadline, or at once
        when the connection closes)."""
        if not keys or not self.lock.acquire(timeout=QUIET_SEND_S):
            return
        try:
            if self._sock is None:
                return  # the connection is gone, and its holds with it
            outer = getattr(self._scope, "deadline", None)
            self._scope.deadline = time.monotonic() + QUIET_SEND_S
            try:
                step = self.max_keys
                self._send_frames(Op.RELEASE_QUIET, [encode_frame(Op.RELEASE_QUIET, self._new_id(),
                                                                  m.encode_keys(keys[i : i + step]))
                                                     for i in range(0, len(keys), step)])
            finally:
                self._scope.deadline = outer
        except DaemonUnavailable as exc:
            log.debug("holds not released now: %s", exc)
        finally:
            self.lock.release()

    def defer_release(self, keys: Sequence[bytes]) -> None:
        """End this connection's read holds on ``keys`` with the next request: inside the next :meth:`get_shm`'s
        frame (GET_SHM_RELEASE), as a RELEASE_QUIET in the same ``send`` as any other request, or alone
        :data:`QUIET_DELAY_S` later if no request comes first (a flusher thread).

        The daemon ends them before it runs anything sent after them. A release that rides with the next
        get saves a syscall here, and a frame and a wake-up of the daemon's loop (on a few shared cores each
        costs about as much as the request's work). Raises :class:`DaemonUnavailable` when not connected.
        """
        self._defer(keys, touch=False)

    def _defer(self, keys: Sequence[bytes], *, touch: bool) -> None:
        """Queue ``keys`` for a RELEASE_QUIET (or, ``touch``, a TOUCH_QUIET) and wake the flusher."""
        with self.locked():
            self._ensure()
            if not self._quiet and not self._touched:
                self._quiet_since = time.monotonic()
            (self._touched if touch else self._quiet).extend(keys)
            self._start_flusher()

    def _start_flusher(self) -> None:
        """Wake (starting it the first time) the thread that sends what waited :data:`QUIET_DELAY_S` (lock held)."""
        if self._flusher is None:
            stop = threading.Event()
            thread = threading.Thread(target=self._flush_later, args=(stop,), name="kvstore-client-release", daemon=True)
            self._flusher = (thread, stop)
            thread.start()
        self._quiet_wake.set()

    def defer_touch(self, keys: Sequence[bytes]) -> None:
        """Report that ``keys`` were read through the slot directory (the daemon counts the hits and marks the
        blocks used), as TOUCH_QUIET frames in the next request's ``send``, or alone :data:`QUIET_DELAY_S`
        later, like :meth:`defer_release`. Raises :class:`DaemonUnavailable` when not connected."""
        self._defer(keys, touch=True)

    def get_shm(self, keys: Sequence[bytes]) -> bytes:
        """GET_SHM of ``keys`` (at most :attr:`max_keys`), carrying the deferred releases when they fit one
        frame (GET_SHM_RELEASE); returns the raw reply payload. Raises like :meth:`request`."""
        with self.locked():
            self._ensure()
            if len(keys) > self.max_keys:
                raise ValueError(f"GET_SHM: {len(keys)} keys in one request, limit is {self.max_keys}")
            if self._quiet and len(self._quiet) <= self.max_keys:
                payload = m.encode_get_release(self._quiet, keys)
                self._quiet = []
                return self.request(Op.GET_SHM_RELEASE, payload)
            return self.request(Op.GET_SHM, m.encode_keys(keys))  # deferred releases go as frames ahead of it

    def send_deferred(self) -> None:
        """Send the releases and uses :meth:`defer_release` and :meth:`defer_touch` deferred, now (nothing when
        there are none or no connection)."""
        with self.lock:
            if (self._quiet or self._touched) and self._sock is not None:
                try:
                    with self.within(QUIET_SEND_S):
                        self._send_frames(Op.RELEASE_QUIET, [])
                except DaemonUnavailable as exc:
                    log.debug("deferred releases not sent: %s", exc)  # the daemon ends those holds at their deadline

    def _deferred_frames(self) -> list[bytes]:
        """The deferred releases as RELEASE_QUIET frames and uses as TOUCH_QUIET frames (lock held), and none
        left deferred."""
        step, frames = self.max_keys, []
        for op, keys in ((Op.RELEASE_QUIET, self._quiet), (Op.TOUCH_QUIET, self._touched)):
            frames += [encode_frame(op, self._new_id(), m.encode_keys(keys[i : i + step])) for i in range(0, len(keys), step)]
        self._quiet, self._touched = [], []
        return frames

    def _send_frames(self, op: Op, frames: list[bytes]) -> None:
        """The deferred releases, then ``frames``, in one ``sendall`` (lock held, connected)."""
        try:
            assert self._sock is not None
            if self._quiet or self._touched:
                frames = [*self._deferred_frames(), *frames]
            self._sock.settimeout(self._remaining(op.name))
            self._sock.sendall(b"".join(frames))
            self._last_used = time.monotonic()
        except (OSError, ProtocolError, DeadlineMissed) as exc:
            self._drop()
            self._next_attempt = 0.0
            if isinstance(exc, (DeadlineMissed, TimeoutError)):
                raise self._missed(DeadlineMissed(f"the daemon at {self.address} did not take {op.name} within the "
                                                  f"call's deadline; the connection is dropped")) from None
            raise self._missed(DaemonUnavailable(f"connection to the daemon at {self.address} broke during "
                                                 f"{op.name}: {exc}")) from None

    def _flush_later(self, stop: threading.Event) -> None:
        """Flusher thread: send deferred releases that waited :data:`QUIET_DELAY_S` for a request to ride with."""
        while not stop.is_set():
            self._quiet_wake.wait()
            if stop.is_set():
                return
            time.sleep(QUIET_DELAY_S)
            if not self.lock.acquire(blocking=False):
                continue  # a request is under way on this connection: it carries them
            try:
                if (self._quiet or self._touched) and time.monotonic() - self._quiet_since >= QUIET_DELAY_S:
                    self.send_deferred()
                if not self._quiet and not self._touched:
                    self._quiet_wake.clear()
            finally:
                self.lock.release()

    def _new_id(self) -> int:
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        return self._next_id

    def _roundtrip(self, op: Op, payload: bytes) -> bytes:
        assert self._sock is not None
        self._last_used = time.monotonic()
        rid = self._new_id()
        frame = encode_frame(op, rid, payload)
        if self._quiet or self._touched:  # deferred releases and uses go first, in the same send
            frame = b"".join([*self._deferred_frames(), frame])
        self._sock.settimeout(self._remaining(op.name))
        self.round_trips += 1  # under the lock: every caller of _roundtrip holds it
        self._sock.sendall(frame)
        header, body = self._read_reply(rid, op)
        if header.op == Op.ERROR:
            code, message = m.decode_error(body)
            if code in (ErrorCode.UNAUTHORIZED, ErrorCode.BAD_LAYOUT, ErrorCode.BAD_VERSION, ErrorCode.TOO_LARGE):
                self._drop()  # fatal on the daemon's side: it closes the connection
            raise DaemonError(code, message)
        if header.op != op | REPLY_BIT:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"{op.name}: got a reply to {header.op_name()}")
        return body

    def _read_reply(self, rid: int, op: Op):  # noqa: ANN202 - (FrameHeader, bytes)
        """Read one reply frame and check it answers request ``rid``."""
        header = decode_header(self._recv(HEADER_SIZE), MAX_REPLY_BYTES)
        body = self._recv(header.length)
        if header.request_id != rid and not (header.op == Op.ERROR and header.request_id == 0):  # 0: refused at accept
            raise ProtocolError(ErrorCode.BAD_FRAME, f"{op.name}: reply to request {header.request_id}, expected {rid}")
        return header, body

    def _recv(self, n: int) -> bytes:
        assert self._sock is not None
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            self._sock.settimeout(self._remaining("(reading the reply)"))
            k = self._sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionResetError("the daemon closed the connection")
            got += k
        return bytes(buf)

    # ------------------------------------------------------ typed requests
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """EXISTS_PREFIX over any number of keys: how many, from the first, the daemon holds."""
        return sum(n for _, n in self.locate_prefix(keys))

    def exists_chain(self, chain: Sequence[bytes], start: int) -> int:
        """EXISTS_CHAIN: how many blocks of ``chain`` (keys from position 0), from position 0, the daemon can
        serve, given the client holds the first ``start``."""
        return start + sum(n for _, n in self.locate_chain(chain, start))

    def locate_prefix(self, keys: Sequence[bytes]) -> m.Runs:
        """EXISTS_PREFIX over any number of keys (split into batches of :attr:`max_keys`): the blocks found from
        the first, as runs by the daemon tier holding them (``host``, ``disk``)."""
        runs: list[tuple[str, int]] = []
        self.ensure()
        step = self.max_keys
        for start in range(0, len(keys), step):
            chunk = list(keys[start : start + step])
            got = m.decode_found(self.request(Op.EXISTS_PREFIX, m.encode_keys(chunk)), Op.EXISTS_PREFIX, len(chunk))
            runs.extend(got)
            if sum(n for _, n in got) < len(chunk):
                break
        return _merged(runs)

    def locate_chain(self, chain: Sequence[bytes], start: int) -> m.Runs:
        """EXISTS_CHAIN: the blocks of ``chain`` (keys from position 0) past the first ``start`` (the client's)
        that the daemon can serve, as runs by the daemon tier holding them (``host``, ``disk``, ``remote``). A
        chain longer than :attr:`max_keys` is probed in its first :attr:`max_keys` keys, then on with
        EXISTS_PREFIX (the daemon's host and disk tiers only)."""
        self.ensure()
        head = list(chain[: self.max_keys])
        if start >= len(head) < len(chain):  # past what one request carries: the local tiers only
            return self.locate_prefix(chain[start:])
        runs = m.decode_found(self.request(Op.EXISTS_CHAIN, m.encode_chain(head, start)), Op.EXISTS_CHAIN,
                              len(head) - start)
        n = start + sum(k for _, k in runs)
        if n == len(head) < len(chain):
            runs += self.locate_prefix(chain[n:])
        return _merged(runs)

    def keys_request(self, op: Op, keys: Sequence[bytes]) -> bytes:
        """Send a keys-only request (at most :attr:`max_keys` keys) and return the raw reply payload."""
        self.ensure()
        if len(keys) > self.max_keys:
            raise ValueError(f"{op.name}: {len(keys)} keys in one request, limit is {self.max_keys}")
        return self.request(op, m.encode_keys(list(keys)))

    def flush(self) -> None:
        """FLUSH: returns once every put the daemon acknowledged is durable on its disk tier.

        Raises :class:`~kvstore.errors.NotDurable` (``blocks``: how many) when blocks it acknowledged
        since this connection's previous FLUSH (its first: since the daemon started) did not reach the disk
        (a full or failing disk).
        """
        try:
            self.request(Op.FLUSH)
        except DaemonError as exc:
            if exc.code == ErrorCode.NOT_DURABLE:
                raise m.decode_not_durable(exc.message) from None
            raise

    def stats(self) -> dict[str, object]:
        """STATS: the daemon's snapshot as a dict."""
        return m.decode_json(self.request(Op.STATS))


def _merged(runs: Sequence[tuple[str, int]]) -> m.Runs:
    """``runs`` with neighbours in the same tier joined (batches answered apart)."""
    out: list[tuple[str, int]] = []
    for tier, n in runs:
        if out and out[-1][0] == tier:
            out[-1] = (tier, out[-1][1] + n)
        else:
            out.append((tier, n))
    return tuple(out)
