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


_UNITS: tuple[tuple[str, int], ...] = (
    ("TiB", 1 << 40), ("TB", 10**12), ("GiB", 1 << 30), ("GB", 10**9),
    ("MiB", 1 << 20), ("MB", 10**6), ("KiB", 1 << 10), ("KB", 10**3),
)
"""The units :data:`Size` accepts that sizes are shown in, binary and SI (as pydantic reads them)."""


def exact_size(n: int) -> str:
    """``n`` bytes written exactly, in the unit giving the shortest text: ``4GB``, ``4GiB``, ``1536MiB``, ``100``.

    Sizes keep the unit family they were given in (``4GB`` is 4 x 10^9 bytes: shown as ``4GB``, not
    ``3906250KiB``), and the text parses back to the same number. On a tie a unit wins over plain bytes
    (``1KiB``, not ``1024``) and a binary unit over an SI one. Pure.
    """
    with_units = [f"{n // factor}{unit}" for unit, factor in _UNITS if n and n % factor == 0]
    best = min(with_units, key=len, default=None)  # min keeps the first of equals: binary before SI
    return best if best is not None and len(best) <= len(str(n)) else str(n)


def format_size(n: int) -> str:
    """``n`` bytes for a person: :func:`exact_size` when that has at most four digits (``4GB``, ``512GiB``),
    else rounded to one decimal in a binary unit (``117.7MiB`` for a measured occupancy). Pure."""
    exact = exact_size(n)
    if len(exact.rstrip("KMGTiB")) <= 4:
        return f"{exact}B" if exact.isdigit() else exact
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{n}B"  # pragma: no cover - the loop always returns


def decimal_size_notes(section: Any, prefix: str = "") -> list[str]:
    """One line per size of the config model ``section`` (recursively) that is a whole number of SI units
    and not of binary ones, saying it in both (``host.capacity: 4GB is 4,000,000,000 bytes (3.73 GiB:
    decimal units); 4GiB would be 4,294,967,296 bytes``): the defaults are binary, so a ``GB`` typed for
    a ``GiB`` is shown, not silently taken. Pure."""
    from pydantic import BaseModel

    notes: list[str] = []
    if not isinstance(section, BaseModel):
        return notes
    for name in type(section).model_fields:
        value = getattr(section, name)
        path = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            notes += decimal_size_notes(value, f"{path}.")
        elif isinstance(value, ByteSize) and value:
            text = exact_size(int(value))
            if text.endswith("B") and not text.endswith("iB"):
                unit, factor = next((u, f) for u, f in _UNITS if text.endswith(u) and not u.endswith("iB"))
                binary = int(value) // factor * _binary(unit)
                notes.append(f"{path}: {text} is {int(value):,} bytes ({int(value) / _binary(unit):.2f} {unit[0]}iB: "
                             f"decimal units); {text[: -len(unit)]}{unit[0]}iB would be {binary:,} bytes")
    return notes


def _binary(unit: str) -> int:
    """The binary unit of the same letter as SI ``unit`` (``GB`` -> 2^30)."""
    return dict(_UNITS)[unit[0] + "iB"]
