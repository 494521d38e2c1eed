"""Config fields that no longer exist, and what took their place.

An old config naming one gets an error that says what to do instead, not just
"unknown key": :func:`replacement` is consulted by the loader for every unknown key.
"""

from __future__ import annotations

REMOVED: dict[str, str] = {
    "host.shm_name": "the daemon's shared arena has no name any more: it is a sealed memfd whose descriptor each "
                     "local client receives over daemon.socket_path at login; delete the field",
}
"""Dotted field path -> what replaced it."""


def replacement(dotted: str) -> str | None:
    """What replaced the removed field ``dotted`` (``None``: it never existed)."""
    return REMOVED.get(dotted)
