"""When blocks are copied to a lower tier: the write policies every tier below the GPU shares.

The store's ``policy.write`` applies them to the host and disk tiers, ``remote.write`` to the remote
tier (which adds ``read_only``); ``write_through_selective`` counts hits against the tier's own
``selective_hits``.
"""

from __future__ import annotations

from typing import Literal

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
"""``write_through``: a block is copied down once committed. ``write_through_selective`` (SGLang HiCache's
semantics): once a lookup has matched it ``selective_hits`` times. ``write_back``: only when it is about to
leave the tier above."""

SELECTIVE_HITS_DEFAULT = 2
"""Hits before a block is copied down under ``write_through_selective`` unless configured."""
