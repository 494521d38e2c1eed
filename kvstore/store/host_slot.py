"""A handle on one host slot, as :class:`~kvstore.store.placement.Placement` hands it out (reserve, pin) and takes it back."""

from __future__ import annotations

from kvstore.errors import short_key


class HostSlot:
    """A handle on one host slot: a write reservation or a read pin, given back exactly once.

    States: ``reserved`` (invisible, being written) -> :meth:`Placement.publish`
    -> ``pinned``; ``pinned`` -> :meth:`Placement.release` -> ``released``;
    ``reserved`` -> :meth:`Placement.abort` -> ``released``
    (:class:`~kvstore.store.placement.Placement`). A second release or abort raises
    :class:`~kvstore.errors.PlacementError`.
    """

    __slots__ = ("key", "slot", "state")

    def __init__(self, key: bytes, slot: int, state: str) -> None:
        self.key = key
        self.slot = slot
        self.state = state

    def __repr__(self) -> str:
        return f"HostSlot({short_key(self.key)}, slot={self.slot}, {self.state})"
