"""The Mooncake conversation trace (FAST'25) as a hit-rate workload.

One JSON object per line: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, the prompt's 512-token blocks remapped
to integers. Ids are prefix-unique (an id always has the same parent), so
they are chain ids already. Only *full* blocks can be cached: a request
contributes ``min(len(hash_ids), input_length // 512)`` blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvstore.bench.workloads import Request, Trace

DEFAULT_TRACE = Path("/work/shared/data/traces/mooncake_conversation_trace.jsonl")
"""Where the trace lives on the project's machines; pass another path with ``--trace``."""

BLOCK_TOKENS = 512


def load_mooncake(path: Path, limit: int | None = None) -> Trace:
    """Read the trace at ``path`` (the first ``limit`` requests when given); ``ValueError`` on a bad line."""
    requests: list[Request] = []
    with path.open() as fh:
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
