"""SIGTERM handled like Ctrl-C: raised as an exception so every ``with``/``finally`` cleanup runs.

Python's default SIGTERM action ends the process at once: temporary
directories of a benchmark (hundreds of MB), child processes and partial
files stay behind. :func:`sigterm_raises` turns SIGTERM into
:class:`Terminated`, a ``KeyboardInterrupt``, so the code that already
cleans up on Ctrl-C cleans up on SIGTERM too. :func:`exit_status` gives the
shell's convention for a process ended by a signal (128 + its number: 130
for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (raised in the main thread by :func:`sigterm_raises`)."""

    signum = int(signal.SIGTERM)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` in the main thread; restores the handler after.

    Outside the main thread (where Python cannot install handlers) it changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_status(exc: KeyboardInterrupt) -> int:
    """128 + the signal that interrupted: 143 for :class:`Terminated`, 130 for Ctrl-C (SIGINT)."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else int(signal.SIGINT))
