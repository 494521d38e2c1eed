"""One soak client process: put key-derived blocks, FLUSH, read earlier blocks back and check every byte.

Run by the soak driver as ``python -m kvstore.bench.soak_client CONFIG DIR CLIENT INCARNATION SEED
[--tenants N]`` and ended only by ``kill -9``. With tenants the client logs in as its identity's tenant
(:func:`~kvstore.bench.soak_blocks.identity`), reads back its own identity's blocks, and asks for a few of
other identities' blocks every round, each of which must miss. It talks to the daemon through the public
client API (:class:`DaemonTier` over :class:`DaemonClient`, shared memory on
the Unix socket) and reports through its journal (:mod:`kvstore.bench.soak_blocks`).

What counts as acknowledged: a block whose ``put`` returned true and which a
later FLUSH on the *same connection* answered successfully. The client's
``generation`` (bumped on every reconnection) is compared before the put and
after the flush: a block put to a daemon that was then killed and restarted
was never made durable, and a FLUSH to the new daemon says nothing about it.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from kvstore.bench.soak_blocks import (
    Journal, OpCounts, block_bytes, block_key, identity, journal_path, read_journals, tenant_token,
)
from kvstore.config import load_config
from kvstore.daemon.client.connection import DaemonUnavailable
from kvstore.daemon.client.tier import DaemonTier
from kvstore.errors import KVStoreError

BATCH = 16
"""Blocks per put and per read-back."""
FLUSH_EVERY = 4
"""Puts between FLUSH requests."""
REPORT_S = 0.5
"""Seconds between ``ops`` journal lines."""
IDLE_S = 0.05
"""Pause after a round in which nothing was stored or found."""
FOREIGN = 4
"""Blocks of other identities asked for per round (with tenants)."""
STOP_PUTS = "no-more-puts"
"""File in the journal directory whose presence means: the disk cap is near, only read from now on."""


def connect(config: Path, name: str, token: str | None = None) -> DaemonTier:
    """A :class:`DaemonTier` connected to the daemon of ``config`` (logging in with ``token`` when given: a
    tenant's), waiting as long as it takes to answer."""
    cfg = load_config(config)
    if token is not None:
        cfg.daemon.token = token
    while True:
        try:
            return DaemonTier.from_config(cfg, client_name=name, wait_s=5.0)
        except DaemonUnavailable:
            continue  # the driver restarts a killed daemon; keep trying until it kills this process


class SoakClient:
    """The work loop of one client incarnation."""

    def __init__(self, tier: DaemonTier, journal: Journal, directory: Path, client: int, incarnation: int,
                 seed: int, tenants: int = 0) -> None:
        self.tier, self.journal, self.directory = tier, journal, directory
        self.client, self.incarnation, self.seed = client, incarnation, seed
        self.bpb = tier.layout.bytes_per_block
        self.rng = random.Random(hash((seed, client, incarnation)))
        self.counts = OpCounts()
        mine = identity(client, tenants)
        self.known: list[bytes] = []  # earlier incarnations' (and same-identity clients') blocks
        self.foreign: list[bytes] = []  # other identities' blocks: never to be served to this client
        for other, keys in read_journals(directory).acked_by_client.items():
            (self.known if identity(other, tenants) == mine else self.foreign).extend(keys)
        self.pending: list[tuple[int, bytes]] = []  # (generation it was put in, key) awaiting a FLUSH
        self.seq = 0

    def run(self) -> None:
        """Loop until killed: put a batch, every few puts FLUSH, read a batch of earlier blocks back."""
        stop_puts = self.directory / STOP_PUTS
        last_report = time.monotonic()
        while True:
            before = (self.counts.puts_ok, self.counts.hits)
            if not stop_puts.exists():
                self.put_batch()
                if self.seq // BATCH % FLUSH_EVERY == 0:
                    self.flush()
            self.read_batch()
            if (self.counts.puts_ok, self.counts.hits) == before:
                time.sleep(IDLE_S)  # the daemon is down (the tier degrades to misses): do not spin
            if time.monotonic() - last_report >= REPORT_S:
                self.journal.counts(self.counts)
                last_report = time.monotonic()

    def put_batch(self) -> None:
        """Put :data:`BATCH` new blocks; remember the acknowledged ones for the next FLUSH."""
        keys = [block_key(self.seed, self.client, self.incarnation, self.seq + i) for i in range(BATCH)]
        self.seq += BATCH
        srcs = [torch.from_numpy(block_bytes(k, self.bpb)) for k in keys]
        generation = self.tier.client.generation
        ok = self.tier.put(keys, srcs)
        self.counts.puts += len(keys)
        self.counts.puts_ok += sum(ok)
        stored = [k for k, o in zip(keys, ok) if o]
        self.known += stored
        if self.tier.client.generation == generation:
            self.pending += [(generation, k) for k in stored]

    def flush(self) -> None:
        """FLUSH; on success journal the pending blocks put on this same connection as acknowledged."""
        try:
            self.tier.flush()
        except KVStoreError:
            self.counts.flush_failures += 1
            return
        self.counts.flushes += 1
        generation = self.tier.client.generation
        acked = [k for g, k in self.pending if g == generation]
        self.pending = []
        self.journal.acked(acked)
        self.counts.acked += len(acked)

    def read_batch(self) -> None:
        """Get up to :data:`BATCH` random earlier blocks and check each served one bit for bit; then ask for a
        few of other identities' blocks, each of which must miss."""
        if self.foreign:
            keys = list(dict.fromkeys(self.rng.choice(self.foreign) for _ in range(FOREIGN)))
            found = self.tier.get(keys, [torch.empty(self.bpb, dtype=torch.uint8) for _ in keys])
            self.counts.foreign_gets += len(keys)
            self.counts.foreign_hits += sum(found)
        if not self.known:
            return
        keys = list(dict.fromkeys(self.rng.choice(self.known) for _ in range(BATCH)))
        dests = [torch.empty(self.bpb, dtype=torch.uint8) for _ in keys]
        found = self.tier.get(keys, dests)
        self.counts.gets += len(keys)
        for key, dest, hit in zip(keys, dests, found):
            if hit:
                self.counts.hits += 1
                if not (dest.numpy() == block_bytes(key, self.bpb)).all():
                    self.counts.wrong += 1
                    self.journal.wrong(key)


def main(argv: list[str] | None = None) -> int:
    """Entry point of a soak client process."""
    p = argparse.ArgumentParser(description="kvstore soak client (started and killed by `kvstore bench soak`)")
    p.add_argument("config", type=Path)
    p.add_argument("directory", type=Path, help="journal directory of the run")
    p.add_argument("client", type=int)
    p.add_argument("incarnation", type=int)
    p.add_argument("seed", type=int)
    p.add_argument("--tenants", type=int, default=0, help="tenants of the run (this client's identity follows)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    journal = Journal(journal_path(a.directory, a.client, a.incarnation))
    k = identity(a.client, a.tenants)
    tier = connect(a.config, f"soak client {a.client}.{a.incarnation}", tenant_token(k) if k else None)
    client = SoakClient(tier, journal, a.directory, a.client, a.incarnation, a.seed, a.tenants)
    journal.counts(client.counts)  # the first line says: connected, working
    client.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
