"""When a block is due to go down to the tier below: the one reading of ``policy.write``.

The embedded store's :class:`~kvstore.store.spill.Spiller` and the daemon's storage
(:class:`~kvstore.daemon.server.backend.DaemonBackend`, also run in-process as :class:`~kvstore.lower.local.LocalTier`)
both ask a :class:`WriteRule`, so the three policies mean the same in every stack::

    write_through            due at commit
    write_through_selective  due once lookups have hit it ``selective_hits`` times
    write_back               due only when it leaves the tier above (evicted, or made room for)

Whatever the policy, a block that leaves a tier with no copy below is copied down first (never dropped), and
a flush writes every block the tier below lacks: those two are not the rule's to decide.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config.schema import PolicyConfig
from kvstore.config.write_policy import SELECTIVE_HITS_DEFAULT, WritePolicy


@dataclass(frozen=True)
class WriteRule:
    """One write policy and its hit threshold. Pure: asking changes nothing."""

    policy: WritePolicy = "write_back"
    selective_hits: int = SELECTIVE_HITS_DEFAULT

    @classmethod
    def from_config(cls, policy: PolicyConfig) -> WriteRule:
        """The rule ``policy.write`` (with ``policy.selective_hits``) names."""
        return cls(policy.write, policy.selective_hits)

    @property
    def at_commit(self) -> bool:
        """Whether a committed block is due at once (``write_through``)."""
        return self.policy == "write_through"

    @property
    def counts_hits(self) -> bool:
        """Whether hits can make a block due (``write_through_selective``): only then are they worth counting."""
        return self.policy == "write_through_selective"

    def due_on_hit(self, hits: int) -> bool:
        """Whether a block lookups have hit ``hits`` times is due now (``write_through_selective`` at
        ``selective_hits``); a block not yet due waits, as under ``write_back``, until it leaves the tier."""
        return self.counts_hits and hits >= self.selective_hits
