"""A description of the machine a benchmark ran on, for ``results.json``.

Numbers from different machines are not comparable, so every result file
says where it came from: CPU model and cores, memory, the filesystem and
block device under the data directory, the accelerator, and versions.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _mem_total_bytes() -> int | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def _filesystem(path: Path) -> dict[str, str]:
    """Mount point, filesystem type and device holding ``path`` (from /proc/mounts)."""
    target = path.resolve()
    best: dict[str, str] = {}
    for line in _read("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        dev, mnt, fstype = parts[0], parts[1], parts[2]
        if (str(target) + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best.get("mount", "")):
            best = {"device": dev, "mount": mnt, "fstype": fstype}
    return best


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def describe_machine(data_dir: Path | None = None) -> dict[str, Any]:
    """CPU, memory, OS, accelerator, versions, and the filesystem under ``data_dir`` when given."""
    desc: dict[str, Any] = {
        "hostname": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": _mem_total_bytes(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "root": os.geteuid() == 0 if hasattr(os, "geteuid") else False,
        "kvstore_commit": _git_commit(),
    }
    if data_dir is not None:
        desc["data_dir"] = str(data_dir)
        desc["filesystem"] = _filesystem(data_dir)
    return desc
