"""One client's share of the daemon's host slots in write holds and quarantine.

A slot reserved is the writer's until it commits, releases or is gone, so a grant cannot be taken back
when another client needs room; instead each grant leaves the others at least as many slots as it
takes. :class:`ReserveShare` is the arithmetic, a frozen snapshot taken under the backend's mutex
(:meth:`~kvstore.daemon.server.client_slots.ClientSlots.share`), so owners reserving at once never both
take one half.
"""

from __future__ import annotations

from dataclasses import dataclass

RESERVE_SHARE = 2
"""An owner may hold at most 1/RESERVE_SHARE (rounded up) of the host slots that other owners leave (those not
in their write holds or quarantined) in write holds and quarantined slots of its own: one client that reserves
everything gets half, a second a quarter, and a well-behaved client still finds slots."""


@dataclass(frozen=True)
class ReserveShare:
    """One owner's part of the host slots in write holds and quarantine, as it asks to reserve more."""

    owner: int
    slots: int
    """Host slots in all."""
    others: int
    """Slots other owners hold in write holds or quarantine."""
    reserved: int
    """Its own write holds."""
    quarantined: int
    """Its own quarantined slots."""

    @property
    def limit(self) -> int:
        """Most slots it may hold in write holds and quarantine: 1/:data:`RESERVE_SHARE` of what the others
        leave, rounded up (a lone owner of a one-slot arena may still write)."""
        return -(-max(0, self.slots - self.others) // RESERVE_SHARE)

    @property
    def room(self) -> int:
        """Slots it may reserve now: none while any of its slots is quarantined (its copies may be running)."""
        return 0 if self.quarantined else max(0, self.limit - self.reserved)
