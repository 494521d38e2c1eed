"""Exception classes: one per kind of failure, all under :class:`KVStoreError`."""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class OutOfBlocks(KVStoreError):
    """The GPU block pool cannot satisfy an allocation; nothing was allocated.

    The scheduler can act on it: evict cached blocks, preempt a sequence, or
    wait. ``requested`` and ``free`` say by how much it fell short.
    """

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"GPU block pool exhausted: requested {requested} blocks, {free} free")
        self.requested = requested
        self.free = free


class IntegrityError(KVStoreError):
    """An internal invariant is broken (a bug, never a user error)."""


class BlockStateError(KVStoreError):
    """An operation was asked of a block in the wrong state (double free, unknown id)."""


class PlacementError(BlockStateError):
    """A placement transition found a block in a state it did not expect (a bug in the caller)."""


def short_key(key: bytes | None) -> str:
    """First 8 bytes of a block key in hex, for messages (``None`` when there is no key)."""
    return "<no key>" if key is None else bytes(key[:8]).hex() + "…"


class CorruptBlock(KVStoreError):
    """A stored block value failed verification (header, length or checksum); never serve it.

    ``reason`` is one of :data:`kvstore.tiers.codec.CORRUPT_REASONS` (``"bad magic"``,
    ``"checksum mismatch"``, ...), so callers and tests can act on it.
    """

    def __init__(self, key: bytes | None, reason: str, detail: str = "") -> None:
        msg = f"corrupt block {short_key(key)}: {reason}"
        super().__init__(f"{msg} ({detail})" if detail else msg)
        self.key = key
        self.reason = reason
        self.detail = detail


class TierError(KVStoreError):
    """A tier cannot be opened or used as configured (pinning impossible, arena too small, closed tier)."""


class DamagedData(TierError):
    """A tier's files are damaged (found before they were mapped); the message names the file and ``kvstore repair``.

    Apart from other :class:`TierError` because it lasts: the same files fail the same way until they are
    repaired, so a daemon remembers it instead of walking them again for every client."""


class NotDurable(KVStoreError):
    """Blocks that were acknowledged as stored did not reach the disk tier (full disk, I/O error).

    ``blocks`` is how many, since the point the caller asked about (its previous flush);
    ``total`` counts them since the daemon started. They are still served from the host tier
    until evicted, but a restart loses them.
    """

    def __init__(self, blocks: int, total: int, detail: str) -> None:
        super().__init__(f"{blocks} acknowledged blocks are not durable: {detail}")
        self.blocks = blocks
        self.total = total
        self.detail = detail
