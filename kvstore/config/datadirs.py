"""Default data directories, one per kind of process, so a demo or an embedded store never opens a daemon's.

A tier's data directory admits one process at a time (an exclusive lock, see
:mod:`kvstore.tiers.datadir`). When ``disk.path`` / ``file.path`` are left
unset, each kind of process (its *role*) gets its own directory under
:data:`DATA_ROOT`, so ``make run`` (the daemon), the README's embedding
example and ``kvstore demo`` can run side by side from one checkout and one
config file. An explicit path is used as given by whoever opens it.
"""

from __future__ import annotations

from typing import Literal

DataRole = Literal["daemon", "embedded", "demo"]
"""Who opens the tiers: ``kvstore serve``, a store in an engine's process (``connector: embedded``), ``kvstore demo``."""

DATA_ROOT = ".kvstore-data"
"""Where relative default data lives (``make clean`` removes it)."""

_ROLE_ROOTS: dict[str, str] = {
    "daemon": DATA_ROOT,
    "embedded": f"{DATA_ROOT}/embedded",
    "demo": f"{DATA_ROOT}/demo",
}

TierDir = Literal["lmdb", "files", "slab"]


def default_data_dir(role: DataRole, tier: TierDir) -> str:
    """The directory ``role`` uses for ``tier`` (``lmdb``: ``disk.path``, ``files``: ``file.path``, ``slab``: ``slab.path``) when unset."""
    return f"{_ROLE_ROOTS[role]}/{tier}"

