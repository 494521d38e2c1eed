"""A daemon refusing an engine's KV layout, and the error that names every field that differs.

At login a client sends only its layout's fingerprint (a hash). When it
differs from the daemon's, the daemon answers ``BAD_LAYOUT`` with its own
layout and the config file it came from (:func:`bad_layout_message`); the
client, which knows its own layout, raises :class:`LayoutMismatch` listing
each differing field with both values and where the daemon's value is set
(:func:`decode_bad_layout`). The layout is only sent to a client that passed
the token check, like every other reply.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvstore.daemon.wire.frames import DaemonError, ErrorCode
from kvstore.layout import KVLayout

LAYOUT_FIELDS: tuple[tuple[str, str], ...] = (
    ("num_layers", "layers"),
    ("num_kv_heads", "KV heads"),
    ("head_dim", "head size"),
    ("block_size", "block size"),
    ("dtype", "dtype"),
    ("model_id", "model id"),
)
"""Each :class:`KVLayout` field in its fingerprint, with the words an error uses for it; its config field is
``model.<field>``."""

_MESSAGE = re.compile(r"; the daemon's layout: (\{.*?\}) from config (.*)$", re.S)


def layout_fields(layout: KVLayout) -> dict[str, Any]:
    """The :data:`LAYOUT_FIELDS` of ``layout`` by name: what HELLO and a ``BAD_LAYOUT`` answer carry as JSON."""
    return {name: getattr(layout, name) for name, _ in LAYOUT_FIELDS}


def layout_from_fields(fields: Any) -> KVLayout:
    """The layout a peer described (a JSON object with exactly the :data:`LAYOUT_FIELDS`); ``ValueError`` naming
    what is missing, extra or invalid."""
    if not isinstance(fields, dict):
        raise ValueError(f"a layout is a JSON object, got {type(fields).__name__}")
    names = [name for name, _ in LAYOUT_FIELDS]
    missing, extra = [n for n in names if n not in fields], sorted(set(fields) - set(names))
    if missing or extra:
        raise ValueError(f"layout fields: missing {missing}, unknown {extra}" if missing and extra else
                         f"layout fields: missing {missing}" if missing else f"layout fields: unknown {extra}")
    if not isinstance(fields["model_id"], str) or not isinstance(fields["dtype"], str):
        raise ValueError("layout fields: model_id and dtype must be strings")
    return KVLayout(**{n: fields[n] for n in names})


def bad_layout_message(client_fingerprint: bytes, daemon: KVLayout, config_source: str) -> str:
    """The ERROR text of a ``BAD_LAYOUT`` HELLO reply: both fingerprints, the daemon's layout (JSON) and config."""
    fields = layout_fields(daemon)
    return (f"HELLO: layout fingerprint {client_fingerprint.hex()} differs from the daemon's "
            f"{daemon.fingerprint.hex()}; the daemon's layout: {json.dumps(fields, sort_keys=True)} "
            f"from config {config_source}")


def decode_bad_layout(message: str) -> tuple[KVLayout, str] | None:
    """Inverse of :func:`bad_layout_message`: ``(daemon layout, config source)``, or ``None`` if the text has
    neither (an older daemon, or a message cut at the 1 KiB error limit)."""
    match = _MESSAGE.search(message)
    if match is None:
        return None
    try:
        return layout_from_fields(json.loads(match.group(1))), match.group(2)
    except ValueError:
        return None


class LayoutMismatch(DaemonError):
    """The daemon serves another KV layout than the engine's; the message names each differing field.

    ``differences`` holds ``(field, engine value, daemon value)`` per
    differing :data:`LAYOUT_FIELDS` entry; ``config_source`` is the daemon's
    config file.
    """

    def __init__(self, engine: KVLayout, daemon: KVLayout, config_source: str, address: str) -> None:
        self.engine, self.daemon, self.config_source = engine, daemon, config_source
        self.differences = [(name, getattr(engine, name), getattr(daemon, name)) for name, _ in LAYOUT_FIELDS
                            if getattr(engine, name) != getattr(daemon, name)]
        labels = dict(LAYOUT_FIELDS)
        listed = "; ".join(f"{labels[name]}: engine {ours!r}, daemon {theirs!r} (model.{name})"
                           for name, ours, theirs in self.differences)
        fields = ", ".join(f"model.{name}" for name, _, _ in self.differences)
        if not self.differences:  # equal fields, different hashes: the two sides hash layouts differently
            listed, fields = "every field agrees but the fingerprints differ (another kvstore version?)", "the model section"
        text = (f"the daemon at {address} serves one model's KV layout (daemon.layouts: model in {config_source}) "
                "and this engine's is another: run it with daemon.layouts: any (make run's configs/default.yaml, "
                "configs/sidecar.yaml) to serve every engine on the host. The differences: "
                f"{listed}; to keep one layout, set {fields} in {config_source} to the engine's values and restart "
                "the daemon")
        super().__init__(ErrorCode.BAD_LAYOUT, text)
        self.args = (text,)  # str() is the explanation alone, without DaemonError's generic prefix
