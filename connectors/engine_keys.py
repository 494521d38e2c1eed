"""kvstore block keys for blocks an inference engine hands over, derived with kvstore's own rules.

Two entry points, one per kind of identity an engine's offload API gives:

- :func:`token_keys`: the engine gives token ids (vLLM's connectors do). The
  keys are exactly kvstore's chained keys (:func:`kvstore.hashing.block_keys`):
  ``key[i] = BLAKE2b(key[i-1] || tokens of block i)`` from
  ``root_key(layout fingerprint, tenant salt)``. The same prefix therefore has
  the same key whichever engine (or kvstore's own engine) stored it.
- :func:`engine_page_keys`: the engine gives only its own page hashes (SGLang's
  HiCache storage API passes ``batch_exists(keys)`` / ``batch_set(keys, ...)``
  with SGLang's chained SHA-256 page hashes, never the tokens). Each key is
  ``BLAKE2b[person=kvstore.epage.v1](root_key(layout, salt) || namespace || page hash)``:
  the layout fingerprint (model id, shape, dtype, block size) and the tenant
  salt are mixed in exactly as for token chains, so two models or two tenants
  never share a page, and the engine's hash already names the whole prefix
  (it chains over every earlier token), so the keys need no chaining of their
  own. A separate BLAKE2b personalisation keeps these keys apart from token
  chain keys: no page hash can ever collide with a token block's key.

Pure functions of their arguments: no globals, no seeds, stable across processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvstore.hashing import KEY_BYTES, Salt, block_keys, root_key
from kvstore.layout import KVLayout

__all__ = ["engine_page_keys", "token_keys"]

_ENGINE_PAGE_PERSON = b"kvstore.epage.v1"


def token_keys(
    token_ids: Sequence[int] | np.ndarray, layout: KVLayout, salt: Salt = None, parent: bytes | None = None
) -> list[bytes]:
    """kvstore's chained key of every *full* ``layout.block_size``-token block of ``token_ids``.

    ``parent`` continues a chain (the key of the block before ``token_ids[0]``).
    An engine whose block size differs from ``layout.block_size`` must hand
    over whole kvstore blocks; the trailing partial block gets no key.
    """
    return block_keys(token_ids, layout, salt, parent)


def engine_page_keys(layout: KVLayout, salt: Salt, namespace: str, page_hashes: Sequence[str]) -> list[bytes]:
    """One 32-byte key per engine page hash, for ``layout`` and tenant ``salt``.

    ``namespace`` names whatever else decides the page's bytes besides the
    layout (the engine, its host byte order, its tensor-parallel shard), so
    pages whose bytes are not interchangeable never share a key. Raises
    ``ValueError`` naming the page for an empty hash.
    """
    ns = namespace.encode("utf-8")
    head = root_key(layout, salt) + len(ns).to_bytes(8, "little") + ns
    keys: list[bytes] = []
    for i, page_hash in enumerate(page_hashes):
        if not page_hash:
            raise ValueError(f"engine page hash {i} of {len(page_hashes)} is empty")
        h = hashlib.blake2b(head, digest_size=KEY_BYTES, person=_ENGINE_PAGE_PERSON)
        h.update(page_hash.encode("utf-8"))
        keys.append(h.digest())
    return keys
