"""Helpers shared by the tier tests: layouts, realistic keys, random blocks."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.errors import TierError
from kvstore.hashing import block_keys
from kvstore.layout import KVLayout

LAYOUTS = {
    "float16": KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", model_id="t"),
    "bfloat16": KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16", model_id="t"),
    "float32": KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", model_id="t"),
}
"""Tiny layouts (512 bytes per fp16 block) so tests stay fast."""

CODEC_NAMES = ("none", "zstd", "shuffle_zstd")


def make_keys(layout: KVLayout, n: int, seed: int = 0, salt: str | None = None) -> list[bytes]:
    """``n`` chained keys of a random prompt, as the store would compute them."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 32_000, size=n * layout.block_size)
    return block_keys(tokens, layout, salt=salt)


def make_blocks(layout: KVLayout, n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` blocks of random values in the layout's dtype, as contiguous uint8 tensors."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        vals = torch.randn(layout.block_shape, generator=gen).to(layout.torch_dtype)
        out.append(vals.reshape(-1).view(torch.uint8).clone())
    return out


def empty_blocks(layout: KVLayout, n: int) -> list[torch.Tensor]:
    """``n`` destination buffers filled with a marker byte."""
    return [torch.full((layout.bytes_per_block,), 0xA5, dtype=torch.uint8) for _ in range(n)]

BIG = KVLayout(num_layers=2, num_kv_heads=2, head_dim=60, block_size=8, dtype="float16", model_id="big")
"""7680-byte blocks: values live in LMDB overflow pages, as real (64 KiB - 2 MiB) blocks do."""


def version_1_value(raw: torch.Tensor, fp: bytes) -> bytes:
    """A value exactly as the version-1 codec wrote it (codec none): CRC-32 over header[0:44] ‖ raw, no key."""
    data = raw.numpy().tobytes()
    prefix = struct.pack("<4sHBB16sQQI", b"KVBK", 1, 0, 2, fp, len(data), len(data), 0)
    return prefix + zlib.crc32(data, zlib.crc32(prefix)).to_bytes(4, "little") + data


def damage_leaf_of(data_file: str, key: bytes, page_size: int = 4096) -> int:
    """Make every ``blocks`` leaf page of ``data_file`` that holds ``key`` unreadable to LMDB (its page flags
    zeroed: "page of the wrong type"); returns how many pages were damaged.

    A ``blocks`` leaf is told from an ``lru`` leaf by the node for ``key``: its value is on overflow pages
    (node flag F_BIGDATA) or longer than an ``lru`` record (16 bytes). Stale copies of the page (copy-on-write
    leftovers on the free list) are damaged too, which changes nothing LMDB reads."""
    with open(data_file, "r+b") as f:
        data = bytearray(f.read())
        damaged = 0
        for start in range(0, len(data) - page_size + 1, page_size):
            page = data[start : start + page_size]
            at = page.find(key)
            if at < 24:
                continue
            lo, hi, flags = struct.unpack_from("<HHH", page, at - 8)
            if flags & 0x01 or (lo | hi << 16) > 16:
                struct.pack_into("<H", data, start + 10, 0)
                damaged += 1
        f.seek(0)
        f.write(data)
    return damaged


def fail_puts_after_first(monkeypatch: pytest.MonkeyPatch, tier_class: type, message: Callable[[Any], str]) -> list[int]:
    """Patch ``tier_class.put``: the first call stores, every later one raises ``TierError(message(tier))`` (a disk
    that filled up). Returns the list the batch size of each call is appended to."""
    real_put, calls = tier_class.put, []

    def put(self: Any, keys: list[bytes], srcs: list[torch.Tensor]) -> list[bool]:
        calls.append(len(keys))
        if len(calls) > 1:
            raise TierError(message(self))
        return real_put(self, keys, srcs)

    monkeypatch.setattr(tier_class, "put", put)
    return calls
