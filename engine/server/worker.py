"""The engine on its own thread: requests queue in, text deltas stream out to asyncio, with in-flight accounting.

The engine (:class:`engine.LLM`) is not thread-safe and its steps block, so
one thread owns it: it admits queued requests, steps while any is unfinished
(continuous batching: concurrent requests share each step), and hands each
request's new text to the event loop that submitted it. The HTTP handlers
only ever touch :meth:`EngineWorker.submit`, :meth:`EngineWorker.cancel` and
:meth:`EngineWorker.load`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceState


@dataclass(frozen=True)
class Usage:
    """OpenAI's ``usage``: ``cached_tokens`` are the prompt tokens this replica did not recompute."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Delta:
    """New output of one request: ``text`` since the last delta; the last one has ``finish_reason`` and ``usage``."""

    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    """Why the engine refused the request (too long for the model or the pool); nothing else comes after it."""


@dataclass(frozen=True)
class Load:
    """What this replica is working on: requests admitted and not finished, and their declared tokens."""

    in_flight_requests: int
    in_flight_tokens: int
    """Sum over in-flight requests of prompt tokens + ``max_tokens``: the work each was admitted for."""


@dataclass(eq=False)
class _Job:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    salt: str | None
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Delta]
    seq: SequenceState | None = None
    sent: int = 0  # characters of output text already handed out
    cancelled: bool = False
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = len(self.token_ids) + self.params.max_tokens

    def emit(self, delta: Delta) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, delta)


class EngineWorker:
    """Owns ``llm`` on a thread started by :meth:`start`; :meth:`close` stops it after the current step."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._cond = threading.Condition()
        self._pending: list[_Job] = []
        self._jobs: dict[str, _Job] = {}
        self._ids = itertools.count()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self.failure: BaseException | None = None
        """The exception that stopped the engine thread, if one did (every request then fails with it)."""
        self.totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "refused": 0}
        """Counters since start (written by the engine thread only)."""

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def close(self) -> None:
        """Stop the engine thread (waits for the step in progress); unfinished requests end with an error."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def load(self) -> Load:
        """In-flight requests and tokens (queued or running), for ``/metrics`` and the router's policy."""
        with self._cond:
            jobs = [*self._pending, *self._jobs.values()]
        return Load(len(jobs), sum(j.tokens for j in jobs))

    async def submit(self, token_ids: list[int], params: SamplingParams, salt: str | None) -> AsyncIterator[Delta]:
        """Queue one request and yield its deltas until the last (``finish_reason`` or ``error`` set).

        Leaving the iteration early (the client went away) aborts the request and frees its blocks.
        """
        job = _Job(f"req-{next(self._ids)}", token_ids, params, salt, asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            if self._closing or self.failure is not None:
                raise RuntimeError(f"the engine is not running ({self.failure or 'shutting down'})")
            self._pending.append(job)
            self._cond.notify()
        finished = False
        try:
            while True:
                delta = await job.out.get()
                yield delta
                if delta.finish_reason is not None or delta.error is not None:
                    finished = True
                    return
        finally:
            if not finished:
                self.cancel(job)

    def cancel(self, job: _Job) -> None:
        """Abort ``job`` at the next step boundary."""
        with self._cond:
            job.cancelled = True
            self._cond.notify()

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._closing and not self._pending and not self._jobs:
                        self._cond.wait()
                    if self._closing:
                        break
                    new, self._pending = self._pending, []
                for job in new:
                    self._admit(job)
                self._drop_cancelled()
                if self.llm.has_unfinished():
                    self.llm.step()
                self._emit_progress()
        except BaseException as exc:  # the engine broke: fail every request rather than hang them
            self.failure = exc
            raise
        finally:
            with self._cond:
                jobs = [*self._pending, *self._jobs.values()]
                self._pending, self._jobs = [], {}
            for job in jobs:
                job.emit(Delta("", error=f"the engine stopped: {self.failure or 'server shutting down'}"))

    def _admit(self, job: _Job) -> None:
        if job.cancelled:
            return
        try:
            job.seq = self.llm.add_request(job.token_ids, job.params, request_id=job.request_id, cache_salt=job.salt)
        except ValueError as exc:  # too long for the model or the pool, token ids outside the vocabulary
            self.totals["refused"] += 1
            job.emit(Delta("", error=str(exc)))
            return
        with self._cond:
            self._jobs[job.request_id] = job

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [j for j in self._jobs.values() if j.cancelled]
            for job in gone:
                del self._jobs[job.request_id]
        for job in gone:
            assert job.seq is not None
            self.llm.abort(job.seq)

    def _emit_progress(self) -> None:
        with self._cond:
            jobs = list(self._jobs.values())
        for job in jobs:
            seq = job.seq
            assert seq is not None
            text = seq.output_text
            if seq.is_finished:
                with self._cond:  # out of the load before the client can see the end
                    self._jobs.pop(job.request_id, None)
                job.emit(Delta(text[job.sent:], seq.finish_reason, self._usage(seq)))
                continue
            # Hold back what may still change: a trailing incomplete UTF-8 character (decoded as one
            # U+FFFD) and a possible start of a stop string, which is cut from the text when it completes.
            safe = len(text) - text.endswith("\ufffd") - max((len(s) - 1 for s in seq.params.stop), default=0)
            if safe > job.sent:
                job.emit(Delta(text[job.sent:safe]))
                job.sent = safe

    def _usage(self, seq: SequenceState) -> Usage:
        usage = Usage(seq.num_prompt_tokens, len(seq.output_token_ids), seq.num_cached_tokens)
        self.totals["requests"] += 1
        self.totals["prompt_tokens"] += usage.prompt_tokens
        self.totals["cached_tokens"] += usage.cached_tokens
        self.totals["generated_tokens"] += usage.completion_tokens
        return usage
