"""A second vLLM engine process for the sidecar tests: ``python offload_proc.py MODEL_DIR KVSTORE_CONFIG REQ_ID``.

Builds vLLM's scheduler with kvstore below its CPU tier (``KVSTORE_CONFIG``
points it at a daemon), runs one request for ``offload_setup.PROMPT`` and
prints one JSON line: the tokens scheduled per step, how many blocks were
loaded and whether they hold the prompt's KV bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import harness as h
from offload_setup import PROMPT, engine, scheduled


def main(model: str, config: str, req_id: str) -> None:
    w = engine(Path(model), Path(config))
    w.scheduler.add_request(h.make_request(req_id, PROMPT))
    outs = w.run(req_id)
    print(json.dumps({"scheduled": scheduled(outs, req_id), "loaded": len(w.loaded.get(req_id, [])),
                      "kv_ok": w.loaded_kv_is(req_id, PROMPT)}), flush=True)
    w.scheduler.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
