"""The base of every config section (its own module so sections may live in their own files)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: strict about unknown keys, docstrings as descriptions."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, validate_default=True, use_attribute_docstrings=True
    )
