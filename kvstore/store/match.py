"""What a lookup of the tiered store returns: the longest cached prefix of a prompt and where its blocks are."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.hashing import Salt
from kvstore.store.radix_node import BlockEntry


@dataclass(frozen=True)
class StoreMatch:
    """The longest cached prefix of a prompt and where its blocks are (fastest copy)."""

    keys: tuple[bytes, ...]
    """Keys of the matched blocks, in order."""
    tiers: tuple[str, ...]
    """``"gpu"``, ``"host"``, ``"disk"`` or ``"remote"`` per matched block: the store's tier it is read from."""
    labels: tuple[str, ...]
    """Per matched block, the name it is reported by (counters, leases, the connector API): its tier, or for a
    tier that fronts others (a daemon, :attr:`~kvstore.tiers.base.Tier.served_as`) the one holding it
    (``"daemon:host"``, ``"daemon:disk"``, ``"daemon:remote"``)."""
    block_size: int
    prompt_tokens: int
    tokens: Sequence[int] | None = None
    """The matched tokens (``num_blocks * block_size``), when the lookup had tokens."""
    salt: Salt = None
    """The tenant salt the keys were made with."""
    entries: tuple[BlockEntry, ...] = field(default=(), repr=False, compare=False)
    """Handles on the matched index entries (a prefix of ``keys``), so ``acquire`` pins them without a second walk."""

    @property
    def num_blocks(self) -> int:
        """Matched full blocks."""
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        """Matched tokens."""
        return len(self.keys) * self.block_size

    def tokens_in(self, tier: str) -> int:
        """Matched tokens whose fastest copy is in ``tier`` (one of :attr:`tiers`)."""
        return self.tiers.count(tier) * self.block_size
