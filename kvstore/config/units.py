"""Byte sizes with units in config files: ``"4GiB"``, ``"512MB"``, ``1048576``."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, ByteSize, Field


def _reject_negative(value: Any) -> Any:
    """Give negative sizes a clear message before pydantic's unit parser sees them."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string like '4GiB', not a boolean")
    if isinstance(value, (int, float)) and value < 0:
        raise ValueError(f"a size cannot be negative (got {value})")
    if isinstance(value, str) and value.strip().startswith("-"):
        raise ValueError(f"a size cannot be negative (got {value!r})")
    return value


Size = Annotated[ByteSize, BeforeValidator(_reject_negative), Field(ge=0)]
"""Non-negative byte count; accepts plain integers or strings with units (KB, MiB, GiB, ...)."""

PositiveSize = Annotated[ByteSize, BeforeValidator(_reject_negative), Field(gt=0)]
"""Byte count greater than zero."""


def format_size(n: int) -> str:
    """Human-readable binary size, e.g. ``1.5 GiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
