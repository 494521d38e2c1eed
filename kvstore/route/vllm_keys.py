"""vLLM 0.33's prefix-cache block hashes, computed by the router so prompts match a vLLM replica's KV events.

vLLM keys a full block by a chain (``vllm/v1/core/kv_cache_utils.py``)::

    NONE_HASH = hash_fn(seed)                         # init_none_hash / resolve_none_hash_seed
    h[0]      = hash_fn((NONE_HASH, tuple(block 0), extra_keys[0]))
    h[i]      = hash_fn((h[i-1],    tuple(block i), extra_keys[i]))   # hash_block_tokens

with ``hash_fn`` named by ``--prefix-caching-hash-algo`` (``vllm/utils/hashing.py``; default
``sha256``: ``sha256(pickle.dumps(obj, protocol=HIGHEST_PROTOCOL))``), ``seed`` the replica's
``PYTHONHASHSEED`` when set, else ``"vllm-none-hash"`` (random per process for the xxhash
algorithms), and ``extra_keys`` ``None`` except the first block of a request with a ``cache_salt``:
``(("cache_salt", salt),)``. LoRA adapters, multimodal inputs and prompt embeddings add extra keys
too; the router does not compute those (such requests are routed by load only on vLLM replicas).

Events carry each hash as vLLM's ``maybe_convert_block_hash`` gives it: with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (vLLM's default) the low 64 bits of the digest as a
big-endian unsigned int, else the digest's bytes; :meth:`VllmKeyScheme.keys` gives the form
the replica publishes.
"""

from __future__ import annotations

import hashlib
import importlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

VllmHashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
"""vLLM's ``prefix_caching_hash_algo`` choices."""

VLLM_HASH_ALGOS: tuple[str, ...] = get_args(VllmHashAlgo)

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's seed of the chain's root when ``PYTHONHASHSEED`` is unset and the algorithm is sha256-based."""

DEFAULT_VLLM_BLOCK_SIZE = 16
"""vLLM's default ``--block-size`` on GPUs."""

_LOW_64 = (1 << 64) - 1


class UnsupportedHashError(ValueError):
    """The router cannot reproduce a replica's block hashes (the reason is in the message)."""


def _serializer(algo: str) -> Callable[[Any], bytes]:
    if algo.endswith("_cbor"):
        try:
            cbor2 = importlib.import_module("cbor2")
        except ImportError:
            raise UnsupportedHashError(
                f"hash={algo} serializes with CBOR, which needs the cbor2 package; it is not a kvstore "
                "dependency and is not installed here (pip install cbor2, or run vLLM with "
                "--prefix-caching-hash-algo sha256)") from None
        dumps: Callable[..., bytes] = cbor2.dumps
        return lambda obj: dumps(obj, canonical=True)
    return lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _digest(algo: str) -> Callable[[bytes], bytes]:
    if algo.startswith("sha256"):
        return lambda data: hashlib.sha256(data).digest()
    try:
        xxhash = importlib.import_module("xxhash")
    except ImportError:
        xxhash = None
    if xxhash is None or not hasattr(xxhash, "xxh3_128_digest"):
        raise UnsupportedHashError(f"hash={algo} needs the xxhash package (with xxh3_128_digest), "
                                   "which is not installed here")
    xxh3: Callable[[bytes], bytes] = xxhash.xxh3_128_digest
    return xxh3


def vllm_hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name(algo)``: serialize (pickle or canonical CBOR), then digest (sha256 or
    xxh3-128). Raises :class:`UnsupportedHashError` for an unknown name or a missing package, naming it."""
    if algo not in VLLM_HASH_ALGOS:
        raise UnsupportedHashError(f"'hash={algo}' is not one of vLLM's {', '.join(VLLM_HASH_ALGOS)}")
    serialize, digest = _serializer(algo), _digest(algo)
    return lambda obj: digest(serialize(obj))


def hash_block_tokens(hash_fn: Callable[[Any], bytes], none_hash: bytes, parent: bytes | None,
                      block_tokens: Sequence[int], extra_keys: tuple[Any, ...] | None = None) -> bytes:
    """vLLM's ``hash_block_tokens``: the hash of one full block after ``parent`` (``None``: the first block,
    chained from ``none_hash``)."""
    return hash_fn((parent or none_hash, tuple(block_tokens), extra_keys))


def event_form(digest: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash`` with int hashes on: the digest's low 64 bits, big-endian."""
    return int.from_bytes(digest, "big") & _LOW_64


@dataclass(frozen=True)
class VllmKeyScheme:
    """How one vLLM replica keys its blocks; replicas configured alike share one scheme (it is hashable).

    Construction checks that the router can reproduce the hashes and raises
    :class:`UnsupportedHashError` saying why not.
    """

    block_size: int = DEFAULT_VLLM_BLOCK_SIZE
    """Tokens per hashed block: the replica's ``--block-size`` (for a model with one KV cache group)."""
    hash_seed: str | None = None
    """The replica's ``PYTHONHASHSEED``, if it sets one (it then seeds the chain for every algorithm)."""
    algo: VllmHashAlgo = "sha256"
    """The replica's ``--prefix-caching-hash-algo``."""
    int_hashes: bool = True
    """The replica's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (vLLM's default: on): its events carry ints."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise UnsupportedHashError(f"block_size must be > 0, got {self.block_size}")
        if self.algo.startswith("xxhash") and self.hash_seed is None:
            raise UnsupportedHashError(
                f"hash={self.algo} without hash_seed: vLLM seeds non-cryptographic hashes with random bytes per "
                "process unless PYTHONHASHSEED is set, so no router can compute that replica's block hashes; "
                "set PYTHONHASHSEED on the replica and give it as hash_seed=")
        vllm_hash_function(self.algo)  # refuses an unknown name or a missing package now, not per request

    @property
    def seed(self) -> str:
        """The string vLLM's ``resolve_none_hash_seed`` gives for this replica."""
        return DEFAULT_NONE_HASH_SEED if self.hash_seed is None else self.hash_seed

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """vLLM's block hashes (digests) of the full blocks of ``token_ids``, for a request with ``cache_salt``
        and no LoRA, multimodal input or prompt embeddings. Pure."""
        hash_fn = vllm_hash_function(self.algo)
        none_hash = hash_fn(self.seed)
        bs = self.block_size
        parent: bytes | None = None
        hashes: list[bytes] = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = hash_block_tokens(hash_fn, none_hash, parent, token_ids[start:start + bs], extra)
            hashes.append(parent)
        return hashes

    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes] | list[int]:
        """The block hashes as the replica's KV events carry them (ints or bytes, per :attr:`int_hashes`)."""
        hashes = self.block_hashes(token_ids, cache_salt)
        return [event_form(h) for h in hashes] if self.int_hashes else hashes
