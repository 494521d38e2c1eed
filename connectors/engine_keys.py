"""kvstore keys and layouts for blocks an external engine (vLLM, SGLang) hands to kvstore.

An engine adapter stores the engine's own bytes: one engine chunk (vLLM) or
page (SGLang) of ``tokens_per_block`` tokens is one kvstore block. The bytes
are opaque to kvstore, so the adapter describes them with an *engine layout*
(:func:`engine_layout`): a :class:`~kvstore.layout.KVLayout` whose
``block_size`` is the engine's tokens per chunk, whose ``bytes_per_block`` is
the chunk's byte size, and whose ``model_id`` names the engine, the model, the
dtype and the byte format, so its fingerprint differs for anything that
changes the bytes.

Keys come from the *token ids*, with kvstore's own rules
(:func:`kvstore.hashing.block_keys`: layout fingerprint, tenant salt, chained
BLAKE2b), never from the engine's block hashes: two models or two tenants
never share a key, and a key means the same prefix in every process.
:class:`PromptKeys` keeps one prompt's chain so that keys for a growing
prompt are hashed once each.

Where an engine gives only its own page hashes and never the tokens (SGLang's
HiCache storage API passes ``batch_exists(keys)`` / ``batch_set(keys, ...)``
with SGLang's chained SHA-256 page hashes), :func:`engine_page_keys` derives
each key as ``BLAKE2b[person=kvstore.epage.v1](root_key(layout, salt) ||
namespace || page hash)``: the layout fingerprint and the tenant salt are
mixed in exactly as for token chains, the engine's hash already names the whole
prefix (it chains over every earlier token), and the separate BLAKE2b
personalisation keeps these keys apart from token-chain keys.

Pure functions of their arguments: no globals, no seeds, stable across processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvstore.hashing import KEY_BYTES, Salt, block_keys, root_key
from kvstore.layout import KVLayout

_ENGINE_PAGE_PERSON = b"kvstore.epage.v1"
_KV_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}


def engine_layout(engine: str, model: str, dtype: str, tokens_per_block: int, block_bytes: int,
                  byte_format: str = "") -> KVLayout:
    """The layout of one engine chunk of ``block_bytes`` bytes holding ``tokens_per_block`` tokens.

    ``dtype`` is the engine's KV dtype name (``"float16"``, ``"torch.bfloat16"``, ``"fp8_e4m3"``...);
    it is part of the identity, and sizes the layout's elements when kvstore knows it (2 bytes otherwise).
    ``byte_format`` is whatever else decides the bytes (tensor-parallel rank, cache layout); put
    there everything two processes must agree on to share blocks. Raises ``ValueError`` naming
    the values when ``block_bytes`` is not a whole number of K and V rows of ``tokens_per_block`` tokens.
    """
    name = dtype.removeprefix("torch.")
    kv_dtype = name if name in _KV_DTYPES else "float16"
    row = 2 * tokens_per_block * _KV_DTYPES[kv_dtype]
    if tokens_per_block <= 0 or block_bytes <= 0 or block_bytes % row:
        raise ValueError(f"{engine} chunk of {block_bytes} bytes for {tokens_per_block} tokens of {name} is not "
                         f"a whole number of K/V rows ({row} bytes each); kvstore cannot lay it out as blocks")
    # The layout only has to describe the byte count: split the elements of one K (or V) row over
    # layers x heads x head_dim within the limits a daemon's ``model:`` section accepts.
    layers, heads, head_dim = _split(block_bytes // row)
    model_id = f"{engine}|{model}|{name}|{block_bytes}B|{byte_format}"
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=tokens_per_block,
                    dtype=kv_dtype, model_id=model_id)  # type: ignore[arg-type]  # kv_dtype is one of _KV_DTYPES


def _split(elements: int) -> tuple[int, int, int]:
    """``(layers, heads, head_dim)`` with product ``elements``, head_dim <= 4096 and the others <= 1024."""
    head_dim = max(d for d in range(1, min(elements, 4096) + 1) if elements % d == 0)
    rest = elements // head_dim
    heads = max(d for d in range(1, min(rest, 1024) + 1) if rest % d == 0)
    layers = rest // heads
    if layers > 1024:
        raise ValueError(f"cannot lay out {elements} elements per token row as layers x heads x head_dim "
                         f"within kvstore's limits (1024 x 1024 x 4096)")
    return layers, heads, head_dim


class PromptKeys:
    """The kvstore key chain of one prompt (which may grow), hashed lazily and once per block."""

    def __init__(self, layout: KVLayout, salt: Salt) -> None:
        self.layout = layout
        self.salt = salt
        self._keys: list[bytes] = []

    def key(self, tokens: Sequence[int], n_blocks: int) -> bytes:
        """Key of block ``n_blocks - 1``: it names ``tokens[: n_blocks * block_size]``.

        ``tokens`` is the prompt (it may have grown since the last call, never changed). Raises
        ``ValueError`` when ``tokens`` has fewer than ``n_blocks`` full blocks.
        """
        return self.keys(tokens, n_blocks)[n_blocks - 1]

    def keys(self, tokens: Sequence[int], n_blocks: int) -> list[bytes]:
        """Keys of the first ``n_blocks`` full blocks of ``tokens`` (see :meth:`key`)."""
        bs = self.layout.block_size
        if n_blocks <= 0 or n_blocks * bs > len(tokens):
            raise ValueError(f"block {n_blocks - 1} ends at token {n_blocks * bs}, past the prompt's "
                             f"{len(tokens)} tokens (or not positive)")
        have = len(self._keys)
        if have < n_blocks:
            parent = self._keys[-1] if have else None
            self._keys += block_keys(list(tokens[have * bs : n_blocks * bs]), self.layout, self.salt, parent=parent)
        return self._keys[:n_blocks]


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
