"""A tier that stores groups of consecutive blocks of a key chain (the remote tier).

Its calls take the chain from its first block (position 0) so the tier can find the group each
position belongs to: positions ``[g*G, g*G+G)`` form group ``g``, stored under ``chain[g*G+G-1]``.
A chained key depends on every token before it, but not the other way round, so a group's key
cannot be derived from one of its earlier blocks; the caller passes the chain.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

from kvstore.tiers.base import Buffer, Tier


class ChainTier(Tier):
    """A :class:`Tier` with grouped access by chain position (see the module docstring)."""

    group_blocks: int = 1
    """``G``: blocks per stored value."""
    probes_by_chain = True

    @abstractmethod
    def probe(self, chain: Sequence[bytes], start: int = 0) -> int:
        """How many blocks of ``chain``, from position 0, are stored, assuming those before the group of
        ``start`` are: checks groups from ``start // G`` on, up to the first missing one. A multiple of
        ``G`` (or ``start`` rounded down to one). Changes nothing."""

    @abstractmethod
    def load(self, chain: Sequence[bytes], start: int, dests: Sequence[Buffer]) -> list[bool]:
        """Fill ``dests[i]`` with the block at position ``start + i`` of ``chain``; ``result[i]`` says
        whether it was filled. ``chain`` must reach the end of the last group asked for."""

    @abstractmethod
    def store(self, chain: Sequence[bytes], start: int, srcs: Sequence[Buffer]) -> int:
        """Store the full groups covered by positions ``[start, start + len(srcs))`` (``start`` a multiple
        of ``G``; a trailing partial group is not stored). Returns the blocks stored or already present."""


def groups_of(start: int, stop: int, g: int) -> range:
    """Indexes of the groups that positions ``[start, stop)`` touch."""
    if stop <= start:
        return range(0)
    return range(start // g, (stop - 1) // g + 1)
