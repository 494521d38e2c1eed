"""What a ``kvstore serve`` daemon holds in memory on each shipped config: idle, then with engines' layouts open.

For ``configs/default.yaml`` (``make run``'s daemon) and ``configs/sidecar.yaml`` (the production one), each
started as shipped with only its paths and port moved into a scratch directory, the daemon's resident set
(``VmRSS``, anonymous part beside it) is read:

- **idle**: started, no client (no layout open: torch not even imported, ``kvstore.tiers``);
- **one layout**: one engine's layout (SmolLM2-135M's, vLLM blocks of 32 tokens, 720 KiB) opened and
  ``--blocks`` of its blocks stored;
- **hostile layout**: then a client with a 4-byte block (``{1 layer, 1 head, head size 1, block 1, fp16}``),
  bounded by ``daemon.max_layout_slots``;
- the same figures for the code as it was before issue 42 are in docs/BENCHMARKS.md (1.36 GB idle on
  ``default.yaml``, +1.3 GB for the hostile layout at 64 MiB of host memory).

Writes JSON to ``--out`` and a PNG beside it (docs/figures/daemon_memory.png is a copy); a markdown table to stdout. Not a test: no assertion.

    .venv/bin/python -m benchmarks.daemon_memory --out docs/results/daemon_memory.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "daemon"))
from daemonlib import shipped_config, start_daemon  # type: ignore[import-not-found]  # noqa: E402  # the tests' daemon starter

from kvstore.daemon.client.connection import DaemonClient  # noqa: E402
from kvstore.daemon.client.tier import DaemonTier  # noqa: E402
from kvstore.hashing import block_keys  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402

ENGINE = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=32, dtype="float32", model_id="smollm2-vllm")
HOSTILE = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype="float16", model_id="tiny")


def _memory(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``RssAnon`` of ``pid``, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon"):
            out[name] = int(value.split()[0]) // 1024
    return out


def _store(socket_path: str, layout: KVLayout, n: int) -> DaemonTier:
    client = DaemonClient(layout, socket_path=socket_path, client_name="bench")
    client.connect(10)
    tier = DaemonTier(layout, client)
    keys = block_keys(list(range(n * layout.block_size)), layout)
    for i in range(0, n, 16):
        batch = keys[i:i + 16]
        tier.put(batch, [torch.full((layout.bytes_per_block,), j % 251, dtype=torch.uint8) for j in range(len(batch))])
    return tier


def measure(name: str, blocks: int) -> dict[str, Any]:
    """The three figures for ``configs/<name>``."""
    with tempfile.TemporaryDirectory(prefix="kvmem", dir="/tmp") as tmp:
        root = Path(tmp)
        d = start_daemon(shipped_config(name, root))
        try:
            time.sleep(1.0)
            row: dict[str, Any] = {"config": name, "idle": _memory(d.proc.pid)}
            engine = _store(d.socket_path, ENGINE, blocks)
            engine.flush()
            row["one_layout"] = _memory(d.proc.pid)
            hostile = _store(d.socket_path, HOSTILE, 64)
            row["hostile_layout"] = _memory(d.proc.pid)
            row["hostile_slots"] = hostile.client.hello.num_slots if hostile.client.hello else None
            engine.client.close()
            hostile.client.close()
        finally:
            d.stop()
    return row


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars: RSS per phase per config, the 200 MB idle bound as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ["idle", "one_layout", "hostile_layout"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.35
    for i, row in enumerate(rows):
        xs = [p + i * width for p in range(len(phases))]
        ax.bar(xs, [row[p]["VmRSS"] for p in phases], width, label=row["config"])
    ax.axhline(200, color="grey", linestyle="--", linewidth=1, label="idle bound (200 MB)")
    ax.set_xticks([p + width / 2 for p in range(len(phases))], ["idle", "one engine layout", "+ 4-byte layout"])
    ax.set_ylabel("daemon RSS (MiB)")
    ax.set_title("kvstore serve memory on the shipped configs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, measure each shipped config, write JSON + PNG, print a table."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.daemon_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("daemon_memory.json"), help="JSON results (PNG beside it)")
    p.add_argument("--blocks", type=int, default=256, help="blocks of the engine layout stored (720 KiB each)")
    args = p.parse_args(argv)
    rows = [measure(name, args.blocks) for name in ("default.yaml", "sidecar.yaml")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"blocks": args.blocks, "rows": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print("| config | idle RSS (MiB) | + one engine layout, %d blocks | + a 4-byte layout |" % args.blocks)
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['idle']['VmRSS']} | {r['one_layout']['VmRSS']} | {r['hostile_layout']['VmRSS']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
