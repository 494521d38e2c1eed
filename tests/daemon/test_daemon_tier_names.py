"""A sidecar connector names a daemon hit by the daemon's tier that held it: ``daemon:host`` or ``daemon:disk``.

A real daemon with an 8-slot host tier (LRU) takes a 12-block prompt in three puts, each flushed (its blocks on
disk, so the host tier may evict them): the first four blocks remain on its disk only, the last eight in host
(and on disk). An engine's sidecar connector then finds the whole prompt there, and its match, its lease and
the store's stats count 16 tokens from the daemon's disk and 32 from its host, in one lookup round trip; once
the engine's own index knows the blocks, its lookup names them the same way. The daemon's ``/metrics`` count the
lookup's hit tokens by the same tiers.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
import yaml

from connectors.sidecar import SidecarConnector
from daemonlib import LAYOUT, Daemon, block_for, cleanup, short_tmpdir, start_daemon, write_config
from kvstore.config import load_config
from kvstore.daemon.wire.frames import Op
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.hashing import block_keys

BS = LAYOUT.block_size
PROMPT = list(range(1000, 1000 + 12 * BS + 2))  # 12 full blocks and a partial one
HOST_SLOTS = 8


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(write_config(root, host={"capacity": HOST_SLOTS * LAYOUT.bytes_per_block},
                                      policy={"placement": "lru"}))
        yield d
        assert d.stop() == 0
    finally:
        cleanup(d, root)


def _scrape(d: Daemon) -> dict[str, str]:
    """The daemon's ``/metrics`` as {sample name with labels: value}."""
    assert d.metrics_url is not None
    with urllib.request.urlopen(f"{d.metrics_url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return dict(line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))


def _store_prompt(d: Daemon, keys: list[bytes]) -> None:
    """Put ``keys`` in batches of 4, flushing after each, so the host tier's LRU keeps only the last 8."""
    tier = d.tier()
    try:
        for at in range(0, len(keys), 4):
            batch = keys[at : at + 4]
            assert tier.put(batch, [block_for(k) for k in batch]) == [True] * len(batch)
            tier.flush()
    finally:
        tier.close()


def test_a_prompt_split_between_the_daemons_host_and_disk_is_counted_by_each(daemon: Daemon) -> None:
    keys = block_keys(PROMPT, LAYOUT)
    _store_prompt(daemon, keys)
    root = daemon.config.parent
    engine_yaml = root / "engine.yaml"
    engine_yaml.write_text(yaml.safe_dump({"connector": "sidecar", "daemon": {"socket_path": daemon.socket_path}}))
    conn = SidecarConnector(load_config(engine_yaml))
    conn.register(GPUBlockPool(LAYOUT, 32, device="cpu"))
    try:
        sent: list[Op] = []
        request = conn._tier.client.request  # type: ignore[union-attr]  # registered above

        def counting(op: Op, *args: object, **kw: object) -> bytes:
            sent.append(op)
            return request(op, *args, **kw)  # type: ignore[arg-type]  # passed through unchanged

        conn._tier.client.request = counting  # type: ignore[union-attr,method-assign]  # count round trips
        match = conn.lookup(PROMPT)
        assert sent.count(Op.EXISTS_CHAIN) + sent.count(Op.EXISTS_PREFIX) == 1, sent  # one round trip
        assert match.tiers == ("daemon:disk",) * 4 + ("daemon:host",) * 8
        expected = {"gpu": 0, "host": 0, "daemon:host": 8 * BS, "daemon:disk": 4 * BS}
        assert match.tokens_by_tier() == expected
        lease = conn.acquire(match)
        assert lease.resolve() == 12 * BS
        lease.wait()
        assert lease.tokens_by_tier() == expected
        conn.release(lease)
        section = conn.stats()["daemon"]
        assert section["hit_tokens"] == 12 * BS
        assert section["hit_tokens_by_tier"] == {"daemon:host": 8 * BS, "daemon:disk": 4 * BS, "daemon:remote": 0}
        assert "sidecar" not in conn.stats() and "disk" not in conn.stats()
        metrics = _scrape(daemon)  # the daemon's own count of the same lookup, by its tier
        assert metrics['kvstore_prefix_hit_tokens_total{tier="host"}'] == str(8 * BS)
        assert metrics['kvstore_prefix_hit_tokens_total{tier="disk"}'] == str(4 * BS)
        assert metrics["kvstore_prefix_cache_hits_total"] == str(12 * BS)

        # Indexed by the engine now, on the daemon only once they leave its GPU: a lookup confirms them with the
        # daemon (which loaded the disk ones into its host tier for the lease) and names each by its tier there.
        assert conn.offload("gpu") == 12 and len(conn.store.h.index) == 12
        again = conn.lookup(PROMPT)
        probe = daemon.tier()
        try:
            held = [name for name, n in probe.locate_prefix(keys) for _ in range(n)]
        finally:
            probe.close()
        assert len(held) == 12 and set(held) <= {"daemon:host", "daemon:disk"}
        assert again.tiers == tuple(held)
    finally:
        conn.close()
