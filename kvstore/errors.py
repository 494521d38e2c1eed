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
