"""Reading a GGUF file: its metadata, its tensor table, and each tensor dequantized to fp32.

The layout (GGUF v2/v3, little-endian)::

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x  (key: string, value_type: u32, value)
    tensor_count x  (name: string, n_dims: u32, dims: u64 x n_dims (innermost first), ggml_type: u32, offset: u64)
    padding to `general.alignment` (default 32)
    tensor data; each tensor at data_start + offset

The ``gguf`` package supplies the type codes, the block sizes and the
dequantization (``gguf.quants.dequantize``). Its ``GGUFReader`` is not used
for the header: it builds several numpy views per string, which takes 6 s on
the 98,000 vocabulary and merge strings of a BPE tokenizer; the parse here
decodes them with ``struct`` in about 0.1 s.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from engine.config import CheckpointError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_U64 = struct.Struct("<Q")

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: ``shape`` in torch order (outermost first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int
    nbytes: int


class GGUFFile:
    """The parsed header of a GGUF file; tensors are read from disk and dequantized on request.

    Raises :class:`CheckpointError` naming the file when it is not a GGUF
    file, is truncated, or uses a version or tensor type this reader does not
    know. Holds no open file handle between calls.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            with self.path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                self.metadata, self.tensors, self.data_start = _parse(mm, str(self.path))
        except CheckpointError:
            raise
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        self.size = self.path.stat().st_size
        for info in self.tensors.values():
            if self.data_start + info.offset + info.nbytes > self.size:
                raise CheckpointError(f"{self.path}: tensor {info.name!r} ends past the end of the file "
                                      f"(truncated download?)")

    def field(self, key: str, default: Any = None) -> Any:
        """Metadata value of ``key`` (a str, number, bool or list), or ``default`` when absent."""
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """Metadata value of ``key``; raises :class:`CheckpointError` naming the key and file when absent."""
        if key not in self.metadata:
            raise CheckpointError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantized to a new, writable fp32 array of its torch-order shape."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing")
        with self.path.open("rb") as f:
            f.seek(self.data_start + info.offset)
            raw = np.fromfile(f, dtype=np.uint8, count=info.nbytes)
        byte_shape = quant_shape_to_byte_shape(info.shape, info.ggml_type)
        values = dequantize(raw.reshape(byte_shape), info.ggml_type)
        return np.array(values, dtype=np.float32, copy=True).reshape(info.shape)


def _parse(mm: mmap.mmap, source: str) -> tuple[dict[str, Any], dict[str, TensorInfo], int]:
    """``(metadata, tensors by name, data_start)`` of the mapped file."""
    if mm[:4] != MAGIC:
        raise CheckpointError(f"{source}: not a GGUF file (magic {bytes(mm[:4])!r}, expected {MAGIC!r})")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", mm, 4)
    if version not in SUPPORTED_VERSIONS:
        raise CheckpointError(f"{source}: GGUF version {version} is not supported; supported: {SUPPORTED_VERSIONS}")
    reader = _Cursor(mm, 24)
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(GGUFValueType(reader.scalar("<I")))
    tensors: dict[str, TensorInfo] = {}
    for _ in range(tensor_count):
        name = reader.string()
        n_dims = reader.scalar("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", mm, reader.pos)
        reader.pos += 8 * n_dims
        raw_type, offset = reader.scalar("<I"), reader.scalar("<Q")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise CheckpointError(f"{source}: tensor {name!r} has unknown ggml type {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        count = prod(dims)
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type, offset, count // block * type_size)
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-reader.pos // alignment) * alignment
    return metadata, tensors, data_start


class _Cursor:
    """A read position in the mapped header."""

    def __init__(self, mm: mmap.mmap, pos: int) -> None:
        self.mm = mm
        self.pos = pos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.mm, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.mm, self.pos)
        start = self.pos + 8
        self.pos = start + length
        if self.pos > len(self.mm):
            raise ValueError("a string runs past the end of the file")
        return self.mm[start:self.pos].decode("utf-8")

    def strings(self, count: int) -> list[str]:
        # One tight loop: a BPE vocabulary and its merges are ~100,000 strings.
        mm, pos, out = self.mm, self.pos, []
        unpack = _U64.unpack_from
        for _ in range(count):
            (length,) = unpack(mm, pos)
            pos += 8
            out.append(mm[pos:pos + length].decode("utf-8"))
            pos += length
        if pos > len(mm):
            raise ValueError("a string array runs past the end of the file")
        self.pos = pos
        return out

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self.scalar("<I"))
            count = self.scalar("<Q")
            if item_type in _SCALAR_FORMATS:
                # Numeric arrays (token types, scores) in one unpack rather than one call per item.
                fmt = _SCALAR_FORMATS[item_type][1]
                items = list(struct.unpack_from(f"<{count}{fmt}", self.mm, self.pos))
                self.pos += struct.calcsize(f"<{count}{fmt}")
                return items
            if item_type == GGUFValueType.STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        return self.scalar(_SCALAR_FORMATS[vtype])
