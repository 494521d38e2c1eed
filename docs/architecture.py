"""Draws docs/architecture.png, the README's picture of kvstore: ``python docs/architecture.py``.

Kept beside the image so the picture changes with the code: edit the boxes here and run it again.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

BOXES = {  # name: (x, y, width, height, text, colour)
    "router": (1.5, 9.0, 9.0, 0.9, "kvstore route: KV-aware router (KV events -> index -> least cost)", "#f2d7a6"),
    "vllm": (0.2, 7.2, 3.6, 1.2, "vLLM\n(KVStoreConnector,\nlayer by layer)", "#cfe3f7"),
    "sglang": (4.2, 7.2, 3.6, 1.2, "SGLang\n(HiCache storage\nbackend)", "#cfe3f7"),
    "engine": (8.2, 7.2, 3.6, 1.2, "built-in engine\n(GPU block pool +\nradix prefix index)", "#cfe3f7"),
    "daemon": (0.2, 2.6, 11.6, 3.8, "", "#eef4e8"),
    "host": (0.6, 4.6, 5.2, 1.2, "host tier: pinned RAM,\nshared-memory arena (zero copy)", "#d5ecc2"),
    "disk": (6.2, 4.6, 5.2, 1.2, "NVMe tier: LMDB\n(checksummed, survives restarts)", "#d5ecc2"),
    "index": (0.6, 3.0, 10.8, 1.0, "kvstore serve: one daemon per host; blocks keyed by chained BLAKE2b of tokens + layout + tenant", "#eef4e8"),
    "redis": (3.0, 0.6, 6.0, 1.2, "remote tier: Redis / Valkey (cluster),\nshared by the fleet", "#f7d4d4"),
}
ARROWS = [("router", "vllm"), ("router", "sglang"), ("router", "engine"), ("vllm", "daemon"), ("sglang", "daemon"),
          ("engine", "daemon"), ("daemon", "redis")]


def draw(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(10, 8.2))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 10.2)
    ax.axis("off")
    for name, (x, y, w, h, text, colour) in BOXES.items():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="#555555", lw=1.2))
        if text:
            ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9.5)
    for src, dst in ARROWS:
        sx, sy, sw, _, _, _ = BOXES[src]
        dx, dy, dw, dh, _, _ = BOXES[dst]
        x0 = sx + sw / 2
        x1 = dx + dw / 2 if dst != "daemon" else x0
        ax.annotate("", xy=(x1, dy + dh + 0.05), xytext=(x0, sy - 0.05),
                    arrowprops={"arrowstyle": "->", "lw": 1.4, "color": "#444444"})
    ax.text(6.0, 6.55, "prefix lookups and block loads / saves over a Unix socket + shared memory",
            ha="center", fontsize=9, style="italic", bbox={"fc": "white", "ec": "none"})
    ax.text(6.0, 2.1, "groups of blocks written through / back; probed by chain position", ha="center", fontsize=9,
            style="italic", bbox={"fc": "white", "ec": "none"})
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    draw(Path(__file__).with_name("architecture.png"))
