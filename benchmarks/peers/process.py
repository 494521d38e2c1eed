"""A peer benchmark script in its own interpreter (the peer's venv), one timed round per request.

The script prints one JSON line ``{"ready": ...}`` after its (slow) imports,
then for every line it reads on stdin one line ``{"round": i, "figures":
[...]}``, and exits at end of input; so the suite interleaves its own
measurements with the peer's without paying the peer's import per round. A
figure is a time, ``{"name", "prompt_tokens", "ms"}``, or a bandwidth,
``{"name", "block_bytes", "gbps"}`` (the LMCache peer's storage rows).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any


class PeerProcess:
    """One running peer script; ``info`` is its ready line."""

    def __init__(self, python: str, script: Path, args: list[str]) -> None:
        """Start ``python script *args`` and wait for its ready line (``RuntimeError`` with its stderr if it dies)."""
        self.script = script
        self._err: IO[str] = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([python, "-W", "ignore", str(script), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self._err.seek(0)
            tail = self._err.read()[-1500:]
            self._err.close()
            raise RuntimeError(f"{self.script.name} exited ({self.proc.wait()}): {tail}")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def round_figures(self) -> list[dict[str, Any]]:
        """Run one round; its figures as the peer printed them."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        figures: list[dict[str, Any]] = self._read()["figures"]
        return figures

    def round(self) -> dict[tuple[str, int], float]:
        """Run one round; ``{(figure name, prompt tokens): ms}`` of its times (bandwidths left out)."""
        return {(f["name"], f["prompt_tokens"]): f["ms"] for f in self.round_figures() if "ms" in f}

    def close(self) -> None:
        """End the process (it exits at end of input)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self._err.close()
