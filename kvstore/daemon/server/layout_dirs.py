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

from kvstore.daemon.wire.layout_check import layout_fields, layout_from_fields
from kvstore.layout import KVLayout

LAYOUTS_DIR = "layouts"
LAYOUT_FILE = "layout.json"
S = TypeVar("S", bound=BaseModel)


LABEL_MODEL_CHARS = 48
"""Most characters of the model's name a layout label keeps (a Hugging Face snapshot path is longer)."""
DIRNAME_CHARS = 120
"""Most characters of a layout directory's name; the fingerprint at its end is always kept whole."""


def layout_label(layout: KVLayout) -> str:
    """How logs, STATS and ``/metrics`` name a layout: ``<model>|<dtype>|<block size>t@<fingerprint start>``.

    An engine layout's model id spells every byte-format field (``vllm-blocks|weights@<digest>|bfloat16|
    737280B|layers=30|...``: :func:`connectors.engine_keys.engine_layout`); an operator needs to tell the
    layouts apart at a glance, so the label keeps the engine, the model's short name, the dtype and the
    block size, and the first 8 hex digits of the fingerprint make it unique (a model id alone may stand
    for several layouts: two dtypes, two block sizes). Every field stays in ``layout.json`` and in
    ``kvstore stats --verbose``.
    """
    return f"{_model_name(layout)}|{_dtype_name(layout)}|{layout.block_size}t@{layout.fingerprint.hex()[:8]}"


def _model_name(layout: KVLayout) -> str:
    """The model's short name: an engine layout's ``<engine>:<weights>`` (a digest cut to 8 hex digits, a path
    to its last part), or the model id's last path part; at most :data:`LABEL_MODEL_CHARS` characters."""
    model_id = layout.model_id or "unnamed"
    parts = model_id.split("|")
    if len(parts) >= 3:  # an engine layout: engine|model|dtype|bytes|format
        engine, model = parts[0].removesuffix("-blocks"), parts[1]
        name = f"{engine}:{_short(model)}"
    else:
        name = _short(model_id)
    return name[-LABEL_MODEL_CHARS:]


def _short(model: str) -> str:
    """``weights@<hex digest>`` cut to 8 digits; a path or repo id to its last part (its revision kept)."""
    if model.startswith("weights@"):
        return model[:len("weights@") + 8]
    return model.rstrip("/").rsplit("/", 1)[-1] or model


def _dtype_name(layout: KVLayout) -> str:
    """An engine layout's own dtype name (``fp8_e4m3``...: its layout's dtype only sizes the rows), else the layout's."""
    parts = (layout.model_id or "").split("|")
    return parts[2] if len(parts) >= 3 and parts[2] else str(layout.dtype)


def layout_dirname(layout: KVLayout) -> str:
    """A file-system-safe directory name for a layout's disk data, at most :data:`DIRNAME_CHARS` characters:
    its model id with anything but letters, digits, dots, dashes and underscores replaced by ``_``, cut to fit,
    then ``_`` and the fingerprint's first 8 hex digits, always whole (two formats of one model with a long id,
    a Hugging Face snapshot path, must never share a directory; a shorter id's name is what earlier versions
    gave it, so their data is found again)."""
    suffix = f"_{layout.fingerprint.hex()[:8]}"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", layout.model_id or "unnamed")
    return name[:DIRNAME_CHARS - len(suffix)] + suffix


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
