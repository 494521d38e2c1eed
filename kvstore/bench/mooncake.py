"""The Mooncake conversation trace (FAST'25) as a hit-rate workload.

One JSON object per line: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, the prompt's 512-token blocks remapped
to integers. Ids are prefix-unique (an id always has the same parent), so
they are chain ids already. Only *full* blocks can be cached: a request
contributes ``min(len(hash_ids), input_length // 512)`` blocks.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import TextIO

import numpy as np

from kvstore.bench.workloads import Request, Trace

BLOCK_TOKENS = 512


def load_mooncake(path: Path, limit: int | None = None) -> Trace:
    """Read the trace at ``path``, plain or gzip-compressed (``.gz``), the first ``limit`` requests when given;
    ``ValueError`` on a bad line."""
    requests: list[Request] = []
    with _open_text(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = row["hash_ids"]
                length = int(row["input_length"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from None
            full = min(len(ids), length // BLOCK_TOKENS)
            requests.append(Request(np.asarray(ids[:full], dtype=np.int64), length))
    return Trace("mooncake", BLOCK_TOKENS, requests,
                 "Mooncake conversation trace (real chat traffic, 512-token blocks)")


def _open_text(path: Path) -> TextIO:
    """``path`` opened for reading text, through gzip when its name ends in ``.gz``."""
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def load_mooncake_timing(path: Path, limit: int | None = None) -> tuple[list[float], list[int]]:
    """Arrival time (seconds from the start) and output length (tokens) of the first ``limit`` requests at
    ``path``, in the order :func:`load_mooncake` returns them; ``ValueError`` on a bad line."""
    arrivals: list[float] = []
    outputs: list[int] = []
    with _open_text(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(arrivals) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                arrivals.append(float(row["timestamp"]) / 1000)
                outputs.append(int(row["output_length"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from None
    return arrivals, outputs
