"""Prometheus text exposition (format 0.0.4) for every ``/metrics`` kvstore serves.

The daemon, ``kvstore engine serve`` and ``kvstore route`` each build a list
of :class:`Family` from one snapshot of their counters and render it here, so
one scrape config reads all three and a name means the same thing wherever it
appears. Written out rather than through ``prometheus_client``'s registry:
each server already keeps its own counters under its own lock, and a snapshot
rendered per scrape is the whole need (the test suite checks every endpoint
with ``prometheus_client``'s parser).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` of a ``/metrics`` answer."""

Kind = Literal["counter", "gauge"]


def label_value(text: str) -> str:
    """``text`` escaped for a Prometheus label value (backslash, double quote, newline)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def labels_text(labels: Mapping[str, str]) -> str:
    """``{a="x",b="y"}`` (keys sorted), or ``""`` for no labels."""
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{label_value(str(v))}"' for k, v in sorted(labels.items())) + "}"


def number(value: float) -> str:
    """A sample value as Prometheus writes it (``+Inf``, ``NaN``; integers without a fraction)."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


@dataclass
class Family:
    """One metric family: a name, its kind, its help text and its samples (labels -> value).

    A counter's name ends in ``_total``; a family with no samples is still written (its ``HELP`` and
    ``TYPE`` say the metric exists even before anything was counted)."""

    name: str
    kind: Kind
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name!r} must end in _total")

    def add(self, value: float, **labels: str) -> Family:
        """Append one sample; returns the family (for chaining)."""
        self.samples.append((labels, value))
        return self


def family(name: str, kind: Kind, help_text: str, value: float | None = None, **labels: str) -> Family:
    """A family with one sample (``value``; ``None``: none yet)."""
    f = Family(name, kind, help_text)
    if value is not None:
        f.add(value, **labels)
    return f


def render(families: Iterable[Family], extra: str = "") -> str:
    """The exposition text of ``families`` (then ``extra``, already in the format: histograms)."""
    lines: list[str] = []
    for f in families:
        lines.append(f"# HELP {f.name} {f.help}")
        lines.append(f"# TYPE {f.name} {f.kind}")
        lines.extend(f"{f.name}{labels_text(labels)} {number(value)}" for labels, value in f.samples)
    text = "\n".join(lines) + "\n"
    return text + extra if extra else text
