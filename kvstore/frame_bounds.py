"""Bounds on the daemon protocol's frames that the config checks as well (``daemon.max_frame_bytes``).

Declared here, below both :mod:`kvstore.daemon.wire.frames` and :mod:`kvstore.config.schema`, so that the config
does not import the daemon: one owner, two readers.
"""

from __future__ import annotations

from kvstore.hashing import KEY_BYTES

PRELOGIN_FRAME_BYTES = 4096
"""Largest frame accepted before login (a HELLO needs far less): an unauthenticated peer
cannot make the daemon buffer more than this per connection."""


def least_max_frame_bytes(bytes_per_block: int) -> int:
    """Smallest frame bound that keeps the daemon usable for blocks of ``bytes_per_block``: one inline block
    with its key and count, and never less than a login frame."""
    return max(PRELOGIN_FRAME_BYTES, 4 + KEY_BYTES + bytes_per_block + 64)
