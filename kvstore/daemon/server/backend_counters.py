"""What the daemon's storage counts as its clients see it (``stats()["counters"]``), in one plain container.

Its own module so that the stats renderers and their tests name every counter without importing the
backend: the fields are the contract (``kvstore_*`` metrics render each one).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BackendCounters:
    """Hits and misses as clients see them, per tier that answered. Changed under the backend's mutex."""

    host_hits: int = 0
    host_misses: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    no_room: int = 0
    """Keys a get or put could not serve because every host slot was pinned or reserved."""
    written_through: int = 0
    """Blocks of inline puts written straight to disk because the host tier had no room for them."""
    bytes_out: int = 0
    """Block bytes handed to clients (held slots and inline replies)."""
    bytes_in: int = 0
    """Block bytes clients stored (committed slots and inline puts)."""
    flush_failures: int = 0
    """FLUSH requests (and the shutdown flush) that reported blocks not durable."""
    owner_releases: int = 0
    """Holds and quarantined slots ended at once because the client process holding them was gone."""
    quarantined: int = 0
    """Write holds that expired, or whose connection closed, with their slot kept from reuse (the writer
    may still copy into it)."""
    share_refused: int = 0
    """Keys a reserve answered BUSY because their connection held its share of the host slots
    (:data:`~kvstore.daemon.server.share.RESERVE_SHARE`) or had quarantined slots (it let reservations expire
    and has not released them)."""
    connection_releases: int = 0
    """Read holds ended at once because the connection that held them closed."""
    prefix_query_tokens: int = 0
    """Tokens of the prefixes clients looked up (EXISTS_PREFIX keys x block size: the daemon sees keys, not tokens)."""
    prefix_hit_tokens: int = 0
    """Of those, the tokens of the leading blocks the daemon held (host or disk, or the remote tier's groups)."""
    prefix_hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    """:attr:`prefix_hit_tokens` by the daemon tier that held each block (``host``, ``disk``, ``remote``): how much of
    a prompt came out of RAM and how much had to be read from disk or fetched, which one total hides."""
