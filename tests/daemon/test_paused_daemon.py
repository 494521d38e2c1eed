"""A daemon that stops answering (SIGSTOP: what a GC pause, a swap storm, a stopped container or a stuck disk
look like to a client) costs a client a few deadlines, never the pause.

Each call has a deadline (``deadlines:``); after ``breaker_failures`` misses in a row the client's breaker opens
and every call is an instant miss; a background probe closes it once the daemon answers, and the blocks stored
before the pause are served again, bit for bit. The built-in engine on a sidecar connector decodes through a
pause exactly as it computes from scratch, without waiting for it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from daemonlib import MODEL, REPO, Daemon, block_for, cleanup, empty_blocks, keys_for, short_tmpdir, start_daemon, write_config
from kvstore.config import load_config
from kvstore.daemon.client.tier import DaemonTier

DEADLINES = {"lookup_ms": 50, "load_floor_ms": 300, "save_ms": 300, "breaker_failures": 3, "breaker_open_s": 0.2,
             "breaker_open_max_s": 0.5, "probe_ms": 300}
PAUSE_S = 6.0


def client_config(root: Path, d: Daemon, model: dict[str, Any] = MODEL, **deadlines: Any) -> Path:
    path = root / f"client-{len(list(root.glob('client-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({"connector": "sidecar", "model": model,
                                    "daemon": {"socket_path": d.socket_path},
                                    "deadlines": {**DEADLINES, **deadlines}}))
    return path


@contextmanager
def paused(d: Daemon) -> Iterator[None]:
    """The daemon stopped (SIGSTOP) inside, continued (SIGCONT) after, whatever happens inside."""
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def wait_closed(tier: DaemonTier, timeout_s: float = 10.0) -> float:
    """Seconds until the tier's breaker is closed again (fails the test past ``timeout_s``)."""
    t0 = time.monotonic()
    while tier.health()["state"] != "closed":
        assert time.monotonic() - t0 < timeout_s, f"the breaker stayed open: {tier.health()}"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_paused_daemon_costs_a_client_its_deadlines_then_nothing_and_serves_again_after() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root))
        tier = DaemonTier.from_config(load_config(client_config(root, d)), "paused-daemon test")
        keys = keys_for(12, seed=41)
        assert tier.put(keys, [block_for(k) for k in keys]) == [True] * 12
        later = keys_for(4, seed=42)
        with paused(d):
            t_pause = time.monotonic()
            n, dt = timed(tier.probe, keys, 0)
            assert n == 0 and dt < 1.0, (n, dt)  # a lookup: its 50 ms deadline, then a miss
            found, dt = timed(tier.get, keys, empty_blocks(12))
            assert found == [False] * 12 and dt < 2.0, dt  # a load: its deadline (300 ms floor + bytes), then a miss
            outcome, dt = timed(tier.put_outcome, later, [block_for(k) for k in later])
            assert outcome.stored == [False] * 4 and outcome.reason is not None and dt < 2.0, (outcome, dt)
            assert outcome.reason.value == "deadline"
            health = tier.health()
            assert health["state"] == "open" and health["opened"] == 1, health
            t0 = time.monotonic()
            for _ in range(200):  # open: every call an instant miss, nothing sent
                assert tier.probe(keys, 0) == 0
                assert tier.get(keys[:2], empty_blocks(2)) == [False, False]
                assert tier.put_outcome(later, [block_for(k) for k in later]).reason.value == "breaker_open"  # type: ignore[union-attr]
            assert time.monotonic() - t0 < 2.0
            assert time.monotonic() - t_pause < 5.0  # the whole pause cost this client seconds, not the pause
            time.sleep(max(0.0, PAUSE_S - (time.monotonic() - t_pause)))
            assert tier.health()["state"] == "open"  # probes cannot close it while the daemon is stopped
        assert wait_closed(tier) < 5.0  # the background probe finds it answering again
        health = tier.health()
        misses = {(row["op"], row["reason"]): row for row in health["misses"]}  # type: ignore[union-attr]
        assert misses[("lookup", "deadline")]["calls"] == 1 and misses[("load", "deadline")]["blocks"] == 12
        assert misses[("load", "breaker_open")]["calls"] == 200
        assert misses[("save", "breaker_open")]["calls"] == 200 and misses[("save", "breaker_open")]["blocks"] == 800
        assert health["closed"] == 1 and health["probes"] >= 1
        dests = empty_blocks(12)
        assert tier.probe(keys, 0) == 12
        assert tier.get(keys, dests) == [True] * 12  # the blocks stored before the pause, bit for bit
        assert all(bool((b == block_for(k)).all()) for k, b in zip(keys, dests))
        assert tier.put(later, [block_for(k) for k in later]) == [True] * 4
        t0 = time.monotonic()
        while (holds := tier.client.stats().get("holds")) != 0:  # nothing the pause left behind stays held
            assert time.monotonic() - t0 < 5.0, f"{holds} host slot holds left after the pause"
            time.sleep(0.1)
        tier.close()
    finally:
        if d is not None and d.proc.poll() is None:
            os.kill(d.proc.pid, signal.SIGCONT)
        cleanup(d, root)


def test_a_daemon_that_stalls_a_load_midway_costs_the_load_deadline_and_its_late_reply_is_never_read() -> None:
    """The daemon answers the lookup, then stops before the load's reply: the get gives up at its deadline,
    drops the connection, and the next get (after SIGCONT) reads its own reply, not the stale one."""
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root))
        cfg = load_config(client_config(root, d, breaker_failures=100))
        tier = DaemonTier.from_config(cfg, "stalled load")
        tier.client.directory = None  # every get asks the daemon (GET_SHM), so the pause falls inside a request
        a, b = keys_for(8, seed=51), keys_for(8, seed=52)
        assert tier.put(a + b, [block_for(k) for k in a + b]) == [True] * 16
        assert tier.probe(a, 0) == 8
        with paused(d):  # the get's request waits in the stopped daemon's socket; its reply comes after SIGCONT
            found, dt = timed(tier.get, a, empty_blocks(8))
            assert found == [False] * 8 and 0.25 < dt < 2.0, dt
        dests = empty_blocks(8)
        assert tier.get(b, dests) == [True] * 8
        assert all(bool((x == block_for(k)).all()) for k, x in zip(b, dests)), "a late reply was read as this one's"
        tier.close()
    finally:
        cleanup(d, root)


ENGINE_MODEL = {"model_id": "builtin-random-seed0", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
                "block_size": 4, "dtype": "float32"}


def test_the_builtin_engine_on_a_sidecar_decodes_through_a_paused_daemon_as_from_scratch() -> None:
    """Its lookup misses at the deadline and it recomputes: the same tokens as an engine with no cache, within
    seconds of a 6 s pause; a daemon stopped between the lookup and the load costs the load's deadline and the
    engine recomputes what did not come."""
    sys.path.insert(0, str(REPO / "tests" / "connector"))
    from connlib import GREEDY, engine_config, prompt

    from connectors import build_connector
    from engine import LLM

    reference = LLM(config=engine_config()).generate([prompt(1, 45)], GREEDY)[0].token_ids
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root, model=ENGINE_MODEL, host={"capacity": 64 * 2048}))
        cfg = client_config(root, d, model=ENGINE_MODEL)
        first = build_connector(load_config(cfg))
        out = LLM(config=engine_config(), connector=first).generate([prompt(1, 45)], GREEDY)[0]
        assert out.token_ids == reference
        first.close()  # flushed: the daemon holds the prompt's 11 full blocks

        during, stalled = build_connector(load_config(cfg)), build_connector(load_config(cfg))
        llm_during = LLM(config=engine_config(), connector=during)
        llm_stalled = LLM(config=engine_config(), connector=stalled)
        with paused(d):
            t0 = time.monotonic()
            out = llm_during.generate([prompt(1, 45)], GREEDY)[0]
            dt = time.monotonic() - t0
            assert out.token_ids == reference
            assert sum(out.metrics.cached_tokens_by_tier.values()) == 0  # recomputed: nothing came from the daemon
            assert dt < 3.0, f"the engine waited {dt:.1f} s on a paused daemon"

        tier = stalled._tier
        assert tier is not None
        locate = tier.locate_chain  # the store's probe of the daemon (the found blocks by daemon tier)

        def probe_then_pause(chain: Any, start: int = 0) -> Any:  # found, then the daemon stops before the load
            found = locate(chain, start)
            os.kill(d.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            return found

        tier.locate_chain = probe_then_pause  # type: ignore[method-assign]
        tier.client.directory = None  # the load asks the daemon (no read straight from the shared slots)
        try:
            t0 = time.monotonic()
            out = llm_stalled.generate([prompt(1, 45)], GREEDY)[0]
            dt = time.monotonic() - t0
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert out.token_ids == reference
        assert sum(out.metrics.cached_tokens_by_tier.values()) == 0
        assert dt < 4.0, f"the engine waited {dt:.1f} s on a stalled load"
        misses = {(r["op"], r["reason"]) for r in tier.health()["misses"]}  # type: ignore[union-attr]
        assert ("load", "deadline") in misses
        # what `kvstore engine serve` shows in /metrics for this connector: the breaker and the misses by reason
        from prometheus_client.parser import text_string_to_metric_families

        from engine.server.metrics import engine_families
        from kvstore.cli.engine_cmd import _daemon_section
        from kvstore.util.prometheus import render

        snapshot = {"replica": "r0", "in_flight_requests": 0, "in_flight_tokens": 0, "totals": {},
                    "gpu_blocks": {"used": 0, "total": 64}, **_daemon_section(during)}
        seen = {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(render(engine_families(snapshot))) for s in f.samples}
        health = during.daemon_health()
        assert health is not None
        assert seen[("kvstore_engine_breaker_opened_total", (("replica", "r0"),))] == health["opened"]
        assert seen[("kvstore_engine_breaker_open", (("replica", "r0"),))] == int(health["state"] == "open")
        assert seen[("kvstore_engine_misses_total", (("op", "lookup"), ("reason", "deadline"), ("replica", "r0")))] >= 1
        during.close()
        stalled.close()
    finally:
        if d is not None and d.proc.poll() is None:
            os.kill(d.proc.pid, signal.SIGCONT)
        cleanup(d, root)


DISK_STALLS_WHILE_FLAG_EXISTS = """
import os, time
from kvstore.tiers.lmdb.tier import DiskTier
_put, _flush = DiskTier.put, DiskTier.flush
def put(self, keys, srcs):
    while os.path.exists({flag!r}):  # a write stuck in the kernel: a slow fsync, a full or hung device
        time.sleep(0.01)
    return _put(self, keys, srcs)
def flush(self):
    while os.path.exists({flag!r}):
        time.sleep(0.01)
    return _flush(self)
DiskTier.put, DiskTier.flush = put, flush
"""


@pytest.mark.parametrize("sync", ["interval", "always"])
def test_a_stalled_disk_write_never_delays_gets_from_host_ram(sync: str) -> None:
    """The daemon's disk stops completing writes (injected: LMDB's put and sync wait on a flag file; a stuck
    fsync cannot be made here without root on a real device). Lookups and gets of blocks in its host RAM are
    answered as fast as before; under ``sync: always`` a put (which waits for its disk write) misses its
    deadline and the client's saves give up, without holding its reads."""
    root = short_tmpdir()
    flag = root / "disk-stalls"
    d = None
    try:
        d = start_daemon(write_config(root, disk={"sync": sync}), before=DISK_STALLS_WHILE_FLAG_EXISTS.format(flag=str(flag)))
        reader = DaemonTier.from_config(load_config(client_config(root, d, breaker_failures=1000)), "reader")
        writer = DaemonTier.from_config(load_config(client_config(root, d, breaker_failures=1000)), "writer")
        reader.client.directory = None  # every get is a request the daemon answers (GET_SHM)
        hot = keys_for(8, seed=61)
        assert writer.put(hot, [block_for(k) for k in hot]) == [True] * 8
        writer.flush()
        baseline = [timed(reader.get, hot, empty_blocks(8))[1] for _ in range(5)]
        flag.touch()
        stuck = threading.Thread(target=lambda: [writer.put(ks, [block_for(k) for k in ks])
                                                 for ks in (keys_for(8, seed=62 + i) for i in range(6))])
        stuck.start()  # puts whose disk writes never complete while the flag exists
        time.sleep(0.5)
        times = []
        for _ in range(20):
            dests = empty_blocks(8)
            found, dt = timed(reader.get, hot, dests)
            assert found == [True] * 8
            assert all(bool((x == block_for(k)).all()) for k, x in zip(hot, dests))
            n, dt_probe = timed(reader.probe, hot, 0)
            assert n == 8
            times.append(max(dt, dt_probe))
        assert max(times) < 0.25, f"gets from host RAM took up to {max(times):.3f} s while the disk stalled " \
                                  f"(before: {max(baseline):.3f} s)"
        stuck.join(10)
        assert not stuck.is_alive(), "a save waited past its deadline"
        flag.unlink()
        reader.close()
        writer.close()
    finally:
        if flag.exists():
            flag.unlink()
        cleanup(d, root)
