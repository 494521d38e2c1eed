"""Block codec: bit-identical round trips, and every kind of damage raises CorruptBlock."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers_testlib import CODEC_NAMES, LAYOUTS, make_blocks, version_1_value

from kvstore.tiers.codec import CODECS, CORRUPT_REASONS, HEADER_SIZE, decode_into, encode, shuffle, unshuffle
from kvstore.errors import CorruptBlock

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


@pytest.mark.parametrize("dtype", sorted(LAYOUTS))
@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_round_trip_bit_identical(dtype: str, codec: str) -> None:
    layout = LAYOUTS[dtype]
    for raw in make_blocks(layout, 3, seed=1):
        value = encode(raw, codec, 3, layout.fingerprint, layout.itemsize, key=KEY)
        assert value[:4] == b"KVBK"
        dest = torch.zeros_like(raw)
        decode_into(value, dest, layout.fingerprint, KEY)
        assert torch.equal(dest, raw)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_round_trip_special_values_and_odd_lengths(codec: str) -> None:
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, 6e-8], dtype=torch.float16)
    raw = specials.view(torch.uint8)
    for itemsize in (1, 2, 4):
        for n in (0, 1, 3, 13, raw.numel()):
            part = raw[:n].clone()
            dest = torch.empty_like(part)
            decode_into(encode(part, codec, 1, bytes(16), itemsize, key=KEY), dest, bytes(16), KEY)
            assert torch.equal(dest, part)


@given(data=st.binary(max_size=200), itemsize=st.sampled_from([1, 2, 4, 8]))
@settings(max_examples=60, deadline=None)
def test_shuffle_inverts(data: bytes, itemsize: int) -> None:
    raw = np.frombuffer(data, dtype=np.uint8)
    planes = shuffle(raw, itemsize)
    out = np.empty_like(raw)
    unshuffle(planes, itemsize, out)
    assert out.tobytes() == data


def test_shuffle_groups_byte_planes() -> None:
    raw = np.array([0x0201, 0x0403, 0x0605], dtype="<u2").view(np.uint8)
    assert shuffle(raw, 2).tolist() == [0x01, 0x03, 0x05, 0x02, 0x04, 0x06]


def _encoded(codec: str = "none") -> tuple[bytes, torch.Tensor, bytes]:
    layout = LAYOUTS["float16"]
    raw = make_blocks(layout, 1, seed=7)[0]
    return encode(raw, codec, 1, layout.fingerprint, 2, key=b"\xab" * 32), raw, layout.fingerprint


def _reason(value: bytes, fp: bytes, size: int) -> str:
    with pytest.raises(CorruptBlock) as info:
        decode_into(value, torch.empty(size, dtype=torch.uint8), fp, key=b"\xab" * 32)
    assert info.value.reason in CORRUPT_REASONS
    assert "abababab" in str(info.value)  # the error names the key
    return info.value.reason


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_every_single_byte_flip_is_caught_or_harmless(codec: str) -> None:
    """A flip raises, or (only in bits zstd ignores in its frame header) decodes to the exact block."""
    value, raw, fp = _encoded(codec)
    harmless = []
    for pos in range(len(value)):
        bad = bytearray(value)
        bad[pos] ^= 0x10
        dest = torch.empty_like(raw)
        try:
            decode_into(bytes(bad), dest, fp, b"\xab" * 32)
        except CorruptBlock as exc:
            assert exc.reason in CORRUPT_REASONS
            continue
        assert torch.equal(dest, raw), f"flip at {pos} served wrong bytes"
        harmless.append(pos - HEADER_SIZE)
    # The header and the raw checksum leave slack only in the zstd frame descriptor (byte 4 of the frame).
    assert all(0 <= p < 6 for p in harmless) and (codec != "none" or not harmless)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_every_truncation_is_caught(codec: str) -> None:
    value, raw, fp = _encoded(codec)
    for cut in range(len(value)):
        reason = _reason(value[:cut], fp, raw.numel())
        assert reason == "truncated"


def test_header_reasons_are_specific() -> None:
    value, raw, fp = _encoded("zstd")
    n = raw.numel()
    assert _reason(b"XXXX" + value[4:], fp, n) == "bad magic"
    assert _reason(value[:4] + struct.pack("<H", 3) + value[6:], fp, n) == "unknown version"
    assert _reason(value[:6] + bytes([9]) + value[7:], fp, n) == "unknown codec"
    assert _reason(value, bytes(16), n) == "foreign fingerprint"
    assert _reason(value, fp, n - 2) == "length mismatch"
    assert _reason(value + b"\0", fp, n) == "length mismatch"
    bad = bytearray(value)
    bad[-3] ^= 0xFF
    assert _reason(bytes(bad), fp, n) in ("decompression error", "checksum mismatch")
    none_value, _, _ = _encoded("none")
    flipped = bytearray(none_value)
    flipped[HEADER_SIZE + 5] ^= 1
    assert _reason(bytes(flipped), fp, n) == "checksum mismatch"


def test_unknown_codec_name_and_bad_fingerprint_rejected() -> None:
    with pytest.raises(ValueError, match="known codecs"):
        encode(b"abc", "lz4", 1, bytes(16), key=KEY)
    with pytest.raises(ValueError, match="16 bytes"):
        encode(b"abc", "none", 1, b"short", key=KEY)
    with pytest.raises(ValueError, match="block key is 32 bytes"):
        encode(b"abc", "none", 1, bytes(16), key=b"short")
    assert sorted(CODECS.by_name) == sorted(CODEC_NAMES)


def test_decode_reads_zero_copy_buffers() -> None:
    value, raw, fp = _encoded("shuffle_zstd")
    dest = np.empty(raw.numel(), dtype=np.uint8)
    decode_into(memoryview(bytearray(value)), dest, fp, b"\xab" * 32)
    assert dest.tobytes() == raw.numpy().tobytes()


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_value_under_another_key_is_refused(codec: str) -> None:
    """The checksum binds the key, so a valid value misplaced under another key is corrupt."""
    layout = LAYOUTS["float16"]
    raw = make_blocks(layout, 1, seed=3)[0]
    value = encode(raw, codec, 1, layout.fingerprint, 2, key=KEY)
    dest = torch.empty_like(raw)
    with pytest.raises(CorruptBlock) as info:
        decode_into(value, dest, layout.fingerprint, OTHER_KEY)
    assert info.value.reason == "checksum mismatch" and "another key" in str(info.value)
    assert info.value.key == OTHER_KEY
    decode_into(value, dest, layout.fingerprint, KEY)
    assert torch.equal(dest, raw)


def test_version_1_values_are_refused_as_old_format() -> None:
    """Version 1 (unbound checksum) cannot prove which key it belongs to: refused, reason "old format"."""
    layout = LAYOUTS["float16"]
    raw = make_blocks(layout, 1, seed=4)[0]
    with pytest.raises(CorruptBlock) as info:
        decode_into(version_1_value(raw, layout.fingerprint), torch.empty_like(raw), layout.fingerprint, KEY)
    assert info.value.reason == "old format"
    assert "version 1" in str(info.value)


def test_encode_parts_written_into_a_reused_buffer_equal_encode() -> None:
    from kvstore.tiers.codec import encode_parts

    key, buf = bytes(range(32)), bytearray()
    for codec in ("none", "zstd", "shuffle_zstd"):
        for size in (4096, 100, 8192):  # the buffer grows, then is reused for a shorter value
            raw = torch.arange(size, dtype=torch.uint8)
            parts = encode_parts(raw, codec, 1, bytes(16), 2, key=key)
            whole = encode(raw, codec, 1, bytes(16), 2, key=key)
            assert parts.join() == whole and len(parts) == len(whole)
            assert bytes(parts.write_into(buf)) == whole and len(buf) >= len(whole)


def test_the_checksum_is_zlibs_crc32_so_values_verify_with_or_without_isal(monkeypatch: pytest.MonkeyPatch) -> None:
    import zlib

    from kvstore.tiers import codec

    rng = np.random.default_rng(7)
    key, header, raw = b"k" * 32, rng.bytes(20), rng.integers(0, 256, 70_000, dtype=np.uint8)
    assert codec._checksum(key, header, raw) == zlib.crc32(raw.data, zlib.crc32(header, zlib.crc32(key)))
    block = torch.from_numpy(rng.integers(0, 256, 4096, dtype=np.uint8))
    fp = b"f" * 16
    monkeypatch.setattr(codec, "crc32", zlib.crc32)  # a writer without isal (the engines' own venvs)
    value = encode(block, "none", 1, fp, key=key)
    monkeypatch.undo()  # a reader with isal, when it is installed
    dest = torch.empty(4096, dtype=torch.uint8)
    decode_into(value, dest, fp, key)
    assert torch.equal(dest, block)
