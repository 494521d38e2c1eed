"""Fixtures of the bench tests: a stand-in for a peer's interpreter."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def fake_python(tmp_path: Path) -> Callable[[str], str]:
    """``fake_python(body)``: the path of an interpreter stand-in that runs ``body`` instead of the script it is
    given (its arguments reach ``body``'s ``sys.argv[1:]``: ``-W ignore SCRIPT ARGS...``)."""

    def make(body: str) -> str:
        script = tmp_path / "fake.py"
        script.write_text(body)
        exe = tmp_path / "python"
        exe.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
        exe.chmod(0o755)
        return str(exe)

    return make
