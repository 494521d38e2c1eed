"""Matplotlib helpers shared by the suites (headless ``Agg`` backend, one PNG per suite)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure as MplFigure  # noqa: E402


def grid(n: int, title: str, ncols: int = 3, size: tuple[float, float] = (4.6, 3.4)) -> tuple[MplFigure, list[Axes]]:
    """A figure with ``n`` panels in rows of ``ncols``; unused panels are hidden."""
    ncols = max(1, min(ncols, n))
    nrows = max(1, math.ceil(n / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, flat[:n]


def grouped_bars(ax: Axes, groups: list[str], series: dict[str, list[float]], ylabel: str,
                 title: str = "", **kwargs: Any) -> None:
    """Bars of several series side by side for each group (NaN draws nothing)."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [0.0 if math.isnan(v) else v for v in values], width, label=label, **kwargs)
    ax.set_xticks(range(len(groups)), groups, rotation=20)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def save(fig: MplFigure, path: Path) -> None:
    """Write ``fig`` as a PNG at ``path`` and release it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
