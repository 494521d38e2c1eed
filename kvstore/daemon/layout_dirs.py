"""Where a daemon serving any layout (``daemon.layouts: any``) keeps each layout's disk tier, and how it is named.

``<disk.path>/layouts/<model id>@<fingerprint start>/`` holds one layout's LMDB environment and ``layout.json``,
the layout's fields: so a restarted daemon, ``kvstore stats`` readers and ``kvstore repair --layout NAME``
(salvage checks every block against its layout) know whose blocks the directory holds.
"""

from __future__ import annotations

import json
import os
import re
from typing import TypeVar

from pydantic import BaseModel

from kvstore.daemon.layout_check import layout_fields, layout_from_fields
from kvstore.layout import KVLayout

LAYOUTS_DIR = "layouts"
LAYOUT_FILE = "layout.json"
S = TypeVar("S", bound=BaseModel)


def layout_label(layout: KVLayout) -> str:
    """``<model id>@<first 8 hex digits of the fingerprint>``: a model id alone may stand for several layouts
    (two dtypes, two block sizes). How logs, STATS and ``/metrics`` name a layout."""
    return f"{layout.model_id or 'unnamed'}@{layout.fingerprint.hex()[:8]}"


def layout_dirname(layout: KVLayout) -> str:
    """A file-system-safe directory name for a layout's disk data: its label with anything but letters, digits,
    dots, dashes and underscores replaced."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", layout_label(layout))[:120]


def layout_section(section: S, name: str) -> S:
    """A disk tier's config section moved to the layout directory ``name`` under its own directory."""
    base = section.directory()  # type: ignore[attr-defined]
    return section.model_copy(update={"path": os.path.join(base, LAYOUTS_DIR, name)})


def write_layout_file(directory: str, layout: KVLayout) -> None:
    """Record ``layout`` in its directory (atomically: written aside, then renamed)."""
    path = os.path.join(directory, LAYOUT_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(layout_fields(layout), f, sort_keys=True)
    os.replace(tmp, path)


def read_layout_file(directory: str) -> KVLayout:
    """The layout recorded in ``directory``; ``ValueError`` naming the file when it is missing or not a layout."""
    path = os.path.join(directory, LAYOUT_FILE)
    try:
        with open(path) as f:
            return layout_from_fields(json.load(f))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the layout of this directory's blocks ({exc})") from None


def recorded_layouts(base: str) -> list[KVLayout]:
    """The layouts with a directory under ``<base>/layouts`` (their ``layout.json``), oldest-used last
    (the most recently changed directory first); a directory whose file cannot be read is skipped."""
    root = os.path.join(base, LAYOUTS_DIR)
    if not os.path.isdir(root):
        return []
    dirs = [os.path.join(root, n) for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, LAYOUT_FILE))]
    out = []
    for d in sorted(dirs, key=os.path.getmtime, reverse=True):
        try:
            out.append(read_layout_file(d))
        except ValueError:
            continue
    return out
