"""Config fields that no longer exist, and what took their place.

An old config naming one gets an error that says what to do instead, not just
"unknown key": :func:`replacement` is consulted by the loader for every unknown key.
"""

from __future__ import annotations

REMOVED: dict[str, str] = {
    "host.shm_name": "the daemon's shared arena has no name any more: it is a sealed memfd whose descriptor each "
                     "local client receives over daemon.socket_path at login; delete the field",
    **{f"{section}.eviction": "policy.placement chooses the order of host and disk together (lru, s3fifo, gdsf "
                              "or adaptive, the default; docs/BENCHMARKS.md \"hitrate\" compares them)"
       for section in ("host", "disk", "file", "slab")},
    **{f"policy.{field}": f"policy.placement names a measured combination instead ({what})" for field, what in (
        ("carry_uses", "gdsf and adaptive carry use counts between tiers"),
        ("exclusive_tiers", "adaptive makes the tiers exclusive under policy.write: write_back"),
        ("use_memory", "adaptive remembers the counts of 4x the capacity of blocks that left"),
        ("duel_scope", "adaptive is one duel for host and disk together"),
        ("gdsf_weight", "adaptive weighs counts damped; gdsf linearly"),
    )},
}
"""Dotted field path -> what replaced it."""


def replacement(dotted: str) -> str | None:
    """What replaced the removed field ``dotted`` (``None``: it never existed)."""
    return REMOVED.get(dotted)
