"""The invariants of a radix index (module docstring of :mod:`kvstore.store.radix`), checked from the root down."""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.errors import IntegrityError
from kvstore.store.radix_node import BlockEntry, RadixNode


def check_index(root: RadixNode, block_size: int, by_key: Mapping[bytes, BlockEntry | RadixNode]) -> None:
    """Raise :class:`IntegrityError` if any invariant of the index under ``root`` is broken; ``by_key`` is its key map.

    Takes the index's parts, not the index, so that :mod:`kvstore.store.radix` imports this module and not the reverse.

    Tree shape and pin counts, token registration, every entry indexed under its key and living in a tier
    (unless its node is pinned), no GPU block or host slot recorded twice. Changes nothing (but makes the
    entries of deferred runs, as any read does).
    """
    seen_gpu: dict[int, bytes] = {}
    seen_host: dict[int, bytes] = {}
    count = 0
    if root.entries or root.parent is not None:
        raise IntegrityError("root must have no entries and no parent")
    for node in root.subtree()[1:]:
        if not node.entries:
            raise IntegrityError("empty non-root node")
        if node.parent is None or node.parent.children.get(node.entries[0].key) is not node:
            raise IntegrityError("node not registered under its parent by its first key")
        if node.pin_count < sum(c.pin_count for c in node.children.values()):
            raise IntegrityError("a node is pinned less than its pinned children")
        if node.pin_count < 0:
            raise IntegrityError("negative pin count")
        if node.tokens is not None:
            if len(node.tokens) != len(node.entries) * block_size:
                raise IntegrityError("a node's tokens do not cover its blocks")
            if node.parent.tok_children.get(node.tok_key) is not node:  # type: ignore[arg-type]
                raise IntegrityError("node with tokens not registered for token walks")
        elif node.tok_key is not None:
            raise IntegrityError("token key without tokens")
        for key, child in node.tok_children.items():
            if child.parent is not node or child.tok_key != key:
                raise IntegrityError("stale token child")
        for e in node.entries:
            count += 1
            if e.node is not node or by_key.get(e.key) is not e:
                raise IntegrityError(f"entry {e.key.hex()[:16]} not indexed consistently")
            if e.tier is None and node.pin_count == 0:
                # Only a pinned node may hold a block that lost its last copy (removed once unpinned).
                raise IntegrityError(f"entry {e.key.hex()[:16]} lives in no tier")
            if e.gpu_block is not None:
                if e.gpu_block in seen_gpu:
                    raise IntegrityError(f"GPU block {e.gpu_block} recorded twice")
                seen_gpu[e.gpu_block] = e.key
            if e.host_slot is not None:
                if e.host_slot in seen_host:
                    raise IntegrityError(f"host slot {e.host_slot} recorded twice")
                seen_host[e.host_slot] = e.key
    if count != len(by_key):
        raise IntegrityError(f"{count} entries in the tree but {len(by_key)} indexed by key")
