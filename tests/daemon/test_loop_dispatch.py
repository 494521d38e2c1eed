"""Requests that only touch host memory run on the daemon's event loop; those that may read the disk do not.

The event loop must never wait for disk I/O (every connection shares it), and
an executor hop costs more than a GET_SHM of host-resident blocks. These
tests pin which requests take which path, and that the fast path keeps the
hold semantics (a held slot is pinned; RELEASE ends it).
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from daemonlib import LAYOUT, block_for, empty_blocks, keys_for, short_tmpdir, write_config
from faultydisk import faulty_backend

from kvstore.config import load_config
from kvstore.daemon.wire import messages as m
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.wire.frames import Op
from kvstore.daemon.server.backend import DaemonBackend
from kvstore.daemon.server.daemon import DaemonServer
from kvstore.daemon.server.holds import HoldTable
from kvstore.daemon.client.tier import DaemonTier
from kvstore.tiers.host.tier import HostTier


@pytest.fixture
def root() -> Iterator[Path]:
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ backend
def test_hold_in_host_pins_and_holds_only_when_every_key_is_in_host(root: Path) -> None:
    backend, _ = faulty_backend(root)
    try:
        on_disk, in_host = keys_for(2, seed=1)
        backend.disk.put([on_disk], [block_for(on_disk)])  # type: ignore[union-attr]
        backend.put_inline([in_host], [block_for(in_host).numpy().data])
        backend.flush()  # the write-behind pins the block until it is on disk
        before = dict(vars(backend.counters))
        assert backend.hold_in_host(7, [in_host, on_disk]) is None  # would need a disk read: nothing changed
        assert backend.host.num_pinned == 0 and len(backend.holds) == 0
        assert dict(vars(backend.counters)) == before
        slots = backend.hold_in_host(7, [in_host, in_host])
        assert slots == [backend.host.slot_of(in_host)] * 2
        assert backend.holds.has(7, "read", in_host) and len(backend.holds) == 2 and backend.host.num_pinned == 1
        assert backend.counters.host_hits == before["host_hits"] + 2
        assert backend.release(7, [in_host, in_host]) == 2
        assert backend.host.num_pinned == 0 and len(backend.holds) == 0
        backend.host.check_integrity()
    finally:
        backend.close()


def test_hold_in_host_without_a_disk_tier_answers_misses() -> None:
    host = HostTier(LAYOUT, 16 * LAYOUT.bytes_per_block, pin_memory="never", auto_evict=True)
    backend = DaemonBackend(LAYOUT, host, None, HoldTable(60.0))  # no disk tier: no writer either
    try:
        here, absent = keys_for(2, seed=2)
        backend.put_inline([here], [block_for(here).numpy().data])
        assert backend.hold_in_host(3, [here, absent]) == [backend.host.slot_of(here), None]
        assert backend.counters.host_misses == 1 and len(backend.holds) == 1
        assert backend.release(3, [here]) == 1
    finally:
        backend.close()


# ------------------------------------------------------------- live server
class RecordingExecutor(ThreadPoolExecutor):
    """Records the op of every request the session hands to the executor."""

    def __init__(self) -> None:
        super().__init__(4, thread_name_prefix="test-daemon")
        self.ops: list[Op] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if args and isinstance(args[0], m.KeysRequest):
            self.ops.append(args[0].op)
        return super().submit(fn, *args, **kwargs)


@pytest.fixture
def served(root: Path) -> Iterator[tuple[DaemonServer, RecordingExecutor]]:
    """A daemon server on an event loop in a thread of this process, with a recording executor."""
    server = DaemonServer(load_config(write_config(root, metrics={"enabled": False})))
    server._executor = executor = RecordingExecutor()  # noqa: SLF001 - the seam this test observes
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    errors: list[BaseException] = []

    async def main() -> None:
        try:
            await server.start()
        except BaseException as exc:
            errors.append(exc)
            raise
        finally:
            ready.set()
        await server.wait_stopped()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    assert ready.wait(30) and not errors, errors
    try:
        yield server, executor
    finally:
        loop.call_soon_threadsafe(server.request_stop)
        thread.join(30)
        loop.close()


def test_host_hits_released_and_committed_without_the_executor(served: tuple[DaemonServer, RecordingExecutor]) -> None:
    server, executor = served
    assert server.info is not None
    client = DaemonClient(LAYOUT, socket_path=server.info.socket_path)
    client.connect(10)
    tier = DaemonTier(LAYOUT, client)
    try:
        keys = keys_for(6, seed=3)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 6
        tier.flush()
        dests = empty_blocks(6)
        assert tier.get(keys, dests) == [True] * 6
        assert all(bool((d == block_for(k)).all()) for k, d in zip(keys, dests))
        assert tier.get(keys[:3], dests[:3]) == [True] * 3
        client.stats()  # its reply comes after the deferred RELEASEs': they have all run
        assert executor.ops == [Op.PUT_SHM_RESERVE]  # it looks keys up on disk; everything else ran on the loop
        assert server.backend is not None and len(server.backend.holds) == 0 and server.backend.host.num_pinned == 0

        # A key only on disk needs a disk read: that GET_SHM goes to the executor, and is served.
        assert server.backend.host.delete([keys[0]]) == 1
        executor.ops.clear()
        got = empty_blocks(2)
        assert tier.get(keys[:2], got) == [True, True]
        assert bool((got[0] == block_for(keys[0])).all()) and bool((got[1] == block_for(keys[1])).all())
        client.stats()
        assert executor.ops == [Op.GET_SHM]
        assert len(server.backend.holds) == 0 and server.backend.host.num_pinned == 0
    finally:
        client.close()
