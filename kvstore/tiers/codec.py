"""The stored form of one block: a fixed header, then the (optionally compressed) payload.

Every tier below the host (LMDB, file) stores exactly what :func:`encode`
returns and reads it back with :func:`decode_into`, which verifies everything
before a caller may use the bytes::

    offset  size  field
         0     4  magic          b"KVBK"
         4     2  version        FORMAT_VERSION (2)
         6     1  codec id       0 none, 1 zstd, 2 shuffle_zstd
         7     1  itemsize       bytes per element (the shuffle's plane count)
         8    16  fingerprint    KVLayout.fingerprint of the writer
        24     8  raw length     bytes of the decoded block
        32     8  payload length bytes after the header
        40     4  reserved       0
        44     4  checksum       CRC-32 of key ‖ header[0:44] ‖ raw block
        48     …  payload

All integers little-endian. The checksum covers the block's 32-byte key, the
header and the decoded block. The key is not stored (the tier finds the value
by it), so a valid value copied or misplaced under another key fails the
checksum like any other damage (probability 2^-32 of passing, as for a flipped
byte: CRC-32 is a corruption check, not an authenticator). A flipped byte in
the header or in a raw payload is always caught;
in a zstd payload a flip either fails decompression or the checksum, or sits
in a bit zstd ignores (the unused bit of the frame descriptor) and decodes to
the exact block. Wrong bytes are never returned.

Checksum choice, measured on the 2-core dev machine over 1 MiB blocks
(CPython 3.11, zlib 1.2.13): ``zlib.crc32`` 3.8 GiB/s, ``zlib.adler32``
3.1 GiB/s, ``sha1`` 1.75 GiB/s, ``sha256`` 1.66 GiB/s, ``blake2b`` 0.83 GiB/s,
``md5`` 0.70 GiB/s (xxhash is not installed; zstd's own xxhash64 frame
checksum would not cover the ``none`` codec). CRC-32 is the fastest, releases
the GIL on large buffers, and detects every burst error up to 32 bits, which
is the failure mode of a torn or bit-rotted page; it is a corruption check,
not an authenticator. For reference zstd level 1 compresses fp16 noise at
about 0.7 GiB/s on the same machine, so the checksum is a small fraction of
a compressed read. The CRC-32 is ISA-L's (``isal``, same
polynomial, initial value and results as ``zlib.crc32``, so values written by
either verify with the other): 22-53 GB/s against zlib's 4.0-4.1 on this
machine (64 MiB / 64 KiB buffers); an environment without ``isal`` falls back
to zlib.

The byte shuffle splits elements into byte planes (for fp16/bf16 all low
bytes, then all high bytes; for fp32 four planes). Exponent bytes of nearby
values repeat, so zstd finds more matches in the planes than in interleaved
bytes.

Format versions: version 1 (before keys were bound into the checksum) is
refused, not read: its checksum cannot tell a misplaced value from the right
one, so serving it would keep the hole version 2 closes. :func:`decode_into`
raises :class:`CorruptBlock` with reason ``"old format"``; the tiers treat it
like any corrupt value (counted in ``corrupt_dropped``, deleted, a miss, a
``"corrupt"`` event), so a cache written by an older build empties itself on
first touch and refills from recomputation. Nothing else needs migrating: it
is a cache.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zstandard

try:  # ISA-L's CRC-32: the polynomial and values of zlib's, 5-12x faster (see the module docstring)
    from isal.isal_zlib import crc32
except ImportError:  # an environment without it (the engines' venvs install kvstore --no-deps): zlib's, same values
    from zlib import crc32

from kvstore.errors import CorruptBlock

MAGIC = b"KVBK"
FORMAT_VERSION = 2
OLD_FORMAT_VERSIONS = frozenset({1})
"""Versions an older build wrote; refused with reason ``"old format"`` (module docstring)."""
KEY_SIZE = 32
_HEADER = struct.Struct("<4sHBB16sQQII")
HEADER_SIZE = _HEADER.size
_CHECKED_PREFIX = HEADER_SIZE - 4  # header bytes covered by the checksum (all but the checksum itself)

CORRUPT_REASONS = (
    "truncated",
    "bad magic",
    "old format",
    "unknown version",
    "unknown codec",
    "bad header",
    "foreign fingerprint",
    "length mismatch",
    "decompression error",
    "checksum mismatch",
)
"""Every ``CorruptBlock.reason`` :func:`decode_into` can raise."""


# ------------------------------------------------------------------ codecs
class NoneCodec:
    """Payload = the raw bytes."""

    name = "none"
    codec_id = 0

    def encode_payload(self, raw: np.ndarray, level: int, itemsize: int) -> memoryview:
        """The raw bytes themselves (no copy; :func:`encode` joins them behind the header)."""
        return raw.data

    def decode_payload(self, payload: memoryview, out: np.ndarray, itemsize: int) -> None:
        """Copy ``payload`` into ``out`` (lengths were checked by the caller)."""
        np.copyto(out, np.frombuffer(payload, dtype=np.uint8))


class ZstdCodec:
    """Payload = one zstd frame of the raw bytes.

    zstd contexts are not thread-safe and cost a few hundred KiB each, so
    every thread keeps its own (the tiers decode on I/O threads).
    """

    name = "zstd"
    codec_id = 1

    def __init__(self) -> None:
        self._local = threading.local()

    def _compressor(self, level: int) -> zstandard.ZstdCompressor:
        cache = self._local.__dict__.setdefault("c", {})
        if level not in cache:
            # No zstd content checksum: the block header's CRC covers the raw bytes already.
            cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
        return cache[level]

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = self._local.__dict__.get("d")
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def _prepare(self, raw: np.ndarray, itemsize: int) -> np.ndarray:
        return raw

    def encode_payload(self, raw: np.ndarray, level: int, itemsize: int) -> bytes:
        """Compress ``raw`` at ``level``."""
        return self._compressor(level).compress(self._prepare(raw, itemsize).data)

    def _inflate_into(self, payload: memoryview, out: np.ndarray) -> None:
        # Stream straight into the destination: no intermediate bytes object.
        try:
            reader = self._decompressor().stream_reader(payload, read_across_frames=False)
            view = out.data
            filled = 0
            while filled < out.size:
                n = reader.readinto(view[filled:])
                if n == 0:
                    break
                filled += n
            extra = reader.read(1) if filled == out.size else b""
        except zstandard.ZstdError as exc:
            raise CorruptBlock(None, "decompression error", str(exc)) from None
        if filled != out.size or extra:
            raise CorruptBlock(None, "length mismatch", f"frame decodes to {'more than ' if extra else ''}{filled} bytes, expected {out.size}")

    def decode_payload(self, payload: memoryview, out: np.ndarray, itemsize: int) -> None:
        """Decompress ``payload`` into ``out``; ``CorruptBlock`` if it is not a frame of exactly ``out.size`` bytes."""
        self._inflate_into(payload, out)


class ShuffleZstdCodec(ZstdCodec):
    """Payload = zstd of the byte planes: byte 0 of every element, then byte 1, ...

    ::

        raw     a0 a1 | b0 b1 | c0 c1 | ... (tail)
        planes  a0 b0 c0 ... | a1 b1 c1 ... | (tail)

    Bytes beyond the last whole element (never present for real blocks) are
    kept unshuffled at the end, so every length round-trips.
    """

    name = "shuffle_zstd"
    codec_id = 2

    def _prepare(self, raw: np.ndarray, itemsize: int) -> np.ndarray:
        return shuffle(raw, itemsize)

    def decode_payload(self, payload: memoryview, out: np.ndarray, itemsize: int) -> None:
        """Decompress into a scratch buffer, then interleave the planes into ``out``."""
        planes = np.empty(out.size, dtype=np.uint8)
        self._inflate_into(payload, planes)
        unshuffle(planes, itemsize, out)


def shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte planes of ``raw`` (a new array); plane ``j`` holds byte ``j`` of each little-endian element."""
    n = raw.size // itemsize
    out = np.empty(raw.size, dtype=np.uint8)
    if itemsize == 1 or n == 0:
        np.copyto(out, raw)
        return out
    elems = raw[: n * itemsize].view(f"<u{itemsize}")
    planes = out[: n * itemsize].reshape(itemsize, n)
    for j in range(itemsize):  # one vectorised pass per plane (2 or 4), not per element
        # The unsafe cast to uint8 keeps exactly byte j of each shifted element.
        np.right_shift(elems, 8 * j, out=planes[j], casting="unsafe")
    out[n * itemsize :] = raw[n * itemsize :]
    return out


def unshuffle(planes: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    """Inverse of :func:`shuffle`: write the interleaved bytes of ``planes`` into ``out``."""
    n = planes.size // itemsize
    if itemsize == 1 or n == 0:
        np.copyto(out, planes)
        return
    dtype = np.dtype(f"<u{itemsize}")
    elems = out[: n * itemsize].view(dtype)
    src = planes[: n * itemsize].reshape(itemsize, n)
    np.copyto(elems, src[0], casting="unsafe")
    for j in range(1, itemsize):
        elems |= src[j].astype(dtype) << dtype.type(8 * j)
    out[n * itemsize :] = planes[n * itemsize :]


@dataclass
class CodecRegistry:
    """Payload codecs by YAML name and by the id stored in the header."""

    by_name: dict[str, Any] = field(default_factory=dict)
    by_id: dict[int, Any] = field(default_factory=dict)

    def register(self, codec: Any) -> None:
        """Add ``codec`` (an object with ``name``, ``codec_id``, ``encode_payload``, ``decode_payload``)."""
        if codec.name in self.by_name or codec.codec_id in self.by_id:
            raise ValueError(f"codec {codec.name!r} (id {codec.codec_id}) is already registered")
        self.by_name[codec.name] = codec
        self.by_id[codec.codec_id] = codec

    def get(self, name: str) -> Any:
        """The codec called ``name``; ``ValueError`` naming the known ones otherwise."""
        try:
            return self.by_name[name]
        except KeyError:
            raise ValueError(f"unknown codec {name!r}; known codecs: {', '.join(sorted(self.by_name))}") from None


def default_codecs() -> CodecRegistry:
    """A registry holding ``none``, ``zstd`` and ``shuffle_zstd``."""
    reg = CodecRegistry()
    for codec in (NoneCodec(), ZstdCodec(), ShuffleZstdCodec()):
        reg.register(codec)
    return reg


CODECS = default_codecs()
"""The codecs the tiers use; register more here by name."""


def as_u8(buf: Any) -> np.ndarray:
    """A zero-copy flat ``uint8`` numpy view of a CPU tensor, numpy array or bytes-like object."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(f"block buffers must be contiguous CPU tensors, got {buf.device} contiguous={buf.is_contiguous()}")
        return buf.reshape(-1).view(torch.uint8).numpy()
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def _checksum(key: bytes, header_prefix: bytes | memoryview, raw: np.ndarray) -> int:
    return crc32(raw.data, crc32(header_prefix, crc32(key)))


def _check_key(key: bytes) -> bytes:
    if len(key) != KEY_SIZE:
        raise ValueError(f"a block key is {KEY_SIZE} bytes, got {len(key)}")
    return bytes(key)


@dataclass(frozen=True)
class EncodedParts:
    """One encoded block as its two pieces, unjoined: ``header + payload`` is what :func:`encode` returns.

    For the ``none`` codec ``payload`` is a view of the caller's block (no copy), so the block must stay
    unchanged until the parts are written. A tier that copies the value anyway (LMDB copies it into its
    own pages) writes the pieces straight into a reused buffer (:meth:`write_into`) instead of joining
    them into a freshly allocated object first.
    """

    header: bytes
    """The :data:`HEADER_SIZE` bytes, checksum included."""
    payload: Any
    """The payload as a bytes-like object."""

    def __len__(self) -> int:
        return HEADER_SIZE + memoryview(self.payload).nbytes

    def write_into(self, buf: bytearray) -> memoryview:
        """Copy header then payload to the start of ``buf`` (grown when too small); returns the view of
        those ``len(self)`` bytes, valid until ``buf`` is next changed."""
        n = len(self)
        if len(buf) < n:
            buf.extend(bytes(n - len(buf)))
        view = memoryview(buf)
        view[:HEADER_SIZE] = self.header
        view[HEADER_SIZE:n] = memoryview(self.payload).cast("B")
        return view[:n]

    def join(self) -> bytes:
        """``header + payload`` as one new bytes object."""
        return b"".join((self.header, self.payload))


def encode_parts(raw: Any, codec: str, level: int, fingerprint: bytes, itemsize: int = 2, *, key: bytes) -> EncodedParts:
    """:func:`encode` without the final join (see :class:`EncodedParts`). Changes nothing."""
    key = _check_key(key)
    if len(fingerprint) != 16:
        raise ValueError(f"a layout fingerprint is 16 bytes, got {len(fingerprint)}")
    if not 1 <= itemsize <= 8:
        raise ValueError(f"itemsize must be 1..8, got {itemsize}")
    impl = CODECS.get(codec)
    data = as_u8(raw)
    payload = impl.encode_payload(data, level, itemsize)
    prefix = _HEADER.pack(MAGIC, FORMAT_VERSION, impl.codec_id, itemsize, fingerprint, data.size, len(payload), 0, 0)
    prefix = prefix[:_CHECKED_PREFIX]
    crc = _checksum(key, prefix, data)
    return EncodedParts(prefix + crc.to_bytes(4, "little"), payload)


def encode(raw: Any, codec: str, level: int, fingerprint: bytes, itemsize: int = 2, *, key: bytes) -> bytes:
    """Header + payload for the block ``raw`` (bytes-like or uint8 CPU tensor) stored under ``key``. Changes nothing.

    ``itemsize`` is the element size the shuffle splits by (``KVLayout.itemsize``);
    it is stored in the header, so decoding does not need it. ``key`` (32 bytes)
    is bound into the checksum, not stored: only :func:`decode_into` with the
    same key accepts the value.
    """
    return encode_parts(raw, codec, level, fingerprint, itemsize, key=key).join()


def decode_into(value: Any, dest: Any, fingerprint: bytes, key: bytes) -> None:
    """Verify ``value`` as the block stored under ``key`` and write it into ``dest``; raise
    :class:`CorruptBlock` on any failure.

    ``value`` may be a zero-copy buffer (LMDB ``buffers=True``); ``dest`` is a
    uint8 CPU tensor, numpy array or writable buffer of exactly the raw length.
    On failure ``dest`` holds unspecified bytes that must not be used. A value
    encoded under a different key fails with ``"checksum mismatch"``; one of
    an :data:`OLD_FORMAT_VERSIONS` version with ``"old format"``.
    """
    key = _check_key(key)
    mv = memoryview(value).cast("B")
    out = as_u8(dest)
    if len(mv) < HEADER_SIZE:
        raise CorruptBlock(key, "truncated", f"{len(mv)} bytes, header needs {HEADER_SIZE}")
    magic, version, codec_id, itemsize, fp, raw_len, payload_len, reserved, crc = _HEADER.unpack_from(mv)
    if magic != MAGIC:
        raise CorruptBlock(key, "bad magic", repr(bytes(magic)))
    if version in OLD_FORMAT_VERSIONS:
        raise CorruptBlock(key, "old format", f"version {version} predates key-bound checksums (this build writes {FORMAT_VERSION}); dropped, recompute it")
    if version != FORMAT_VERSION:
        raise CorruptBlock(key, "unknown version", f"version {version}, this build reads {FORMAT_VERSION}")
    impl = CODECS.by_id.get(codec_id)
    if impl is None:
        raise CorruptBlock(key, "unknown codec", f"codec id {codec_id}")
    if not 1 <= itemsize <= 8 or reserved != 0:
        raise CorruptBlock(key, "bad header", f"itemsize {itemsize}, reserved {reserved}")
    if fp != fingerprint:
        raise CorruptBlock(key, "foreign fingerprint", f"{fp.hex()} != {fingerprint.hex()}")
    if raw_len != out.size:
        raise CorruptBlock(key, "length mismatch", f"raw length {raw_len}, destination {out.size}")
    have = len(mv) - HEADER_SIZE
    if have < payload_len:
        raise CorruptBlock(key, "truncated", f"payload {have} of {payload_len} bytes")
    if have > payload_len:
        raise CorruptBlock(key, "length mismatch", f"{have - payload_len} trailing bytes")
    try:
        impl.decode_payload(mv[HEADER_SIZE:], out, itemsize)
    except CorruptBlock as exc:
        raise CorruptBlock(key, exc.reason, exc.detail) from None
    if _checksum(key, mv[:_CHECKED_PREFIX], out) != crc:
        raise CorruptBlock(key, "checksum mismatch", "damaged, or a value stored under another key")


def encoded_length(value: Any, offset: int, key: bytes) -> int:
    """Length of the encoded block starting at ``offset`` of ``value`` (header + payload), read from its
    header; for values that hold several encoded blocks back to back. Raises :class:`CorruptBlock`
    (``"truncated"``) when the header or the payload it announces runs past the end. Changes nothing."""
    mv = memoryview(value).cast("B")
    if len(mv) - offset < HEADER_SIZE:
        raise CorruptBlock(key, "truncated", f"{max(0, len(mv) - offset)} bytes at offset {offset}, header needs {HEADER_SIZE}")
    payload_len = _HEADER.unpack_from(mv, offset)[6]
    if len(mv) - offset - HEADER_SIZE < payload_len:
        raise CorruptBlock(key, "truncated", f"payload {len(mv) - offset - HEADER_SIZE} of {payload_len} bytes at offset {offset}")
    return int(HEADER_SIZE + payload_len)


def encoded_size_bound(raw_len: int) -> int:
    """Upper bound of ``len(encode(...))`` for a raw block of ``raw_len`` bytes (for capacity planning)."""
    return HEADER_SIZE + raw_len + raw_len // 128 + 1024

