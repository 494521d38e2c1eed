"""Soak suite data: block keys, bytes derived from keys, and the clients' append-only journals.

Every block's bytes are a pure function of its key (:func:`block_bytes`), so
any reader can check a served block bit for bit without knowing who wrote it.

A client process may be killed (``kill -9``) at any moment, so it reports to
the soak driver through a journal file of JSON lines, each written with one
``os.write`` on an ``O_APPEND`` descriptor: a line is either whole or, for
the very last one of a killed process, cut short, and :func:`read_journal`
skips a cut-short line. Lines::

    {"ev": "ack", "keys": ["<hex>", ...]}     keys a FLUSH acknowledged (durable from then on)
    {"ev": "wrong", "key": "<hex>"}           a get returned bytes other than block_bytes(key)
    {"ev": "ops", "puts": .., ...}            the incarnation's cumulative counters (last one wins)

With tenants (``kvstore bench soak --tenants N``) each client has an
identity (:func:`identity`): untenanted local clients share one namespace and
each tenant has its own, so a block is readable only by clients of the
identity that stored it; a hit on another identity's block is a leak
(:attr:`OpCounts.foreign_hits`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

KEY_BYTES = 32


def block_key(seed: int, client: int, incarnation: int, seq: int) -> bytes:
    """The ``seq``-th key written by incarnation ``incarnation`` of client ``client`` in run ``seed``."""
    return hashlib.blake2b(f"soak:{seed}:{client}:{incarnation}:{seq}".encode(), digest_size=KEY_BYTES).digest()


def block_bytes(key: bytes, nbytes: int) -> np.ndarray:
    """The only correct content of block ``key``: a 64-byte digest of the key, repeated to ``nbytes``."""
    seed = np.frombuffer(hashlib.blake2b(key, digest_size=64).digest(), dtype=np.uint8)
    return np.resize(seed, nbytes)


@dataclass
class OpCounts:
    """What one client incarnation did (cumulative)."""

    puts: int = 0
    """Blocks offered to the daemon."""
    puts_ok: int = 0
    """Blocks the daemon acknowledged (``put`` returned true)."""
    gets: int = 0
    """Blocks asked for."""
    hits: int = 0
    """Blocks served (each checked against :func:`block_bytes`)."""
    flushes: int = 0
    """FLUSH requests that succeeded."""
    flush_failures: int = 0
    """FLUSH requests that raised (daemon down, or an error reply)."""
    acked: int = 0
    """Blocks a successful FLUSH acknowledged on the connection that stored them."""
    wrong: int = 0
    """Served blocks whose bytes were wrong."""
    foreign_gets: int = 0
    """Blocks of another identity (another tenant, or untenanted clients) asked for: each must miss."""
    foreign_hits: int = 0
    """Blocks of another identity that were served: a breach of tenant isolation."""

    def add(self, other: OpCounts) -> None:
        """Add ``other``'s counters to these (changes ``self``)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class JournalView:
    """What the journals of a run say, merged."""

    acked: list[bytes] = field(default_factory=list)
    """Every acknowledged key, in journal order (no duplicates)."""
    acked_by_client: dict[int, list[bytes]] = field(default_factory=dict)
    """The same keys by the client index that stored them (its identity owns them)."""
    wrong: list[bytes] = field(default_factory=list)
    """Every key served with wrong bytes."""
    counts: OpCounts = field(default_factory=OpCounts)
    """Sum over incarnations of each one's last ``ops`` line."""


class Journal:
    """The append-only journal of one client incarnation (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def _line(self, doc: dict[str, object]) -> None:
        os.write(self._fd, (json.dumps(doc, separators=(",", ":")) + "\n").encode())

    def acked(self, keys: list[bytes]) -> None:
        """Record keys a FLUSH acknowledged."""
        if keys:
            self._line({"ev": "ack", "keys": [k.hex() for k in keys]})

    def wrong(self, key: bytes) -> None:
        """Record a block served with wrong bytes."""
        self._line({"ev": "wrong", "key": key.hex()})

    def counts(self, counts: OpCounts) -> None:
        """Record the incarnation's counters so far."""
        self._line({"ev": "ops", **{f.name: getattr(counts, f.name) for f in fields(counts)}})

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)


def identity(client: int, tenants: int) -> int:
    """Whose namespace client ``client`` uses among ``tenants`` tenants: 0 for untenanted local clients, ``k``
    for tenant ``k`` (clients take turns: with 2 tenants, clients 0 and 3 are untenanted, 1 and 2 tenants)."""
    return client % (tenants + 1)


def tenant_token(k: int) -> str:
    """The login token of tenant ``k`` (>= 1) in a soak run."""
    return f"soak-tenant-{k}-token"


def tenant_salt(k: int) -> str:
    """The key salt of tenant ``k`` in a soak run (``daemon.tenant_salts``)."""
    return f"soak-tenant-{k}-salt"


def journal_path(directory: Path, client: int, incarnation: int) -> Path:
    """Where incarnation ``incarnation`` of client ``client`` writes its journal."""
    return directory / f"journal-{client}-{incarnation}.jsonl"


def read_journals(directory: Path) -> JournalView:
    """Merge every journal under ``directory``; a cut-short last line (a killed writer) is skipped."""
    view = JournalView()
    seen: set[bytes] = set()
    for path in sorted(directory.glob("journal-*.jsonl")):
        client = int(path.name.split("-")[1])
        last = OpCounts()
        for line in path.read_text().splitlines():
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue  # the write a kill -9 interrupted
            if doc["ev"] == "ack":
                for key in map(bytes.fromhex, doc["keys"]):
                    if key not in seen:
                        seen.add(key)
                        view.acked.append(key)
                        view.acked_by_client.setdefault(client, []).append(key)
            elif doc["ev"] == "wrong":
                view.wrong.append(bytes.fromhex(doc["key"]))
            elif doc["ev"] == "ops":
                last = OpCounts(**{f.name: int(doc[f.name]) for f in fields(OpCounts)})
        view.counts.add(last)
    return view
