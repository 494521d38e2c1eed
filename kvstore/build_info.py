"""What build of kvstore is running: its version and the versions of what it runs on.

Read by ``kvstore --version`` and by the daemon's ``kvstore_build_info`` metric.
"""

from __future__ import annotations

import platform
import sys


def installed_version() -> str:
    """The version of the installed ``kvstore`` distribution (``kvstore.__version__`` when run uninstalled)."""
    import importlib.metadata  # only when asked: importing it costs every command ~0.1 s

    try:
        return importlib.metadata.version("kvstore")
    except importlib.metadata.PackageNotFoundError:
        from kvstore import __version__

        return __version__


def build_info(version: str | None = None) -> dict[str, str]:
    """``version`` (``version`` when given: a caller asking often reads it once), ``python`` and, when torch is
    already imported, ``torch`` (never imported for this: a daemon imports it when its first layout opens)."""
    info = {"version": version or installed_version(), "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = str(getattr(torch, "__version__", "unknown"))
    return info
