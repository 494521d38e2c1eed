"""Stand-ins for ``torchvision`` and ``tvm_ffi``, installed before SGLang is imported in the SGLang tests.

Why: importing ``sglang.srt.mem_cache`` (and the cache controller) pulls in
SGLang's model configs and multimodal utilities, which import
``torchvision.transforms`` and ``tvm_ffi`` at module level. The cache code
under test never calls them. Installing the real ``torchvision`` would replace
the CPU torch 2.13.0 of this environment with a CUDA 2.14 build, and
``tvm_ffi`` ships native code for GPUs; so the test environment has neither,
and this meta-path hook answers those two imports with empty modules whose
attributes are placeholder classes (enough for ``from torchvision.transforms
import InterpolationMode`` and class-level constants such as
``InterpolationMode.BICUBIC``). It never shadows a real installation: it is
installed only when the package cannot be found. ``__version__`` is set so
that transformers' version probe (``is_torchvision_greater_or_equal``) reads a
version instead of failing to parse ``"N/A"``. A real server on a GPU machine
has both packages and needs none of this.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

STUBBED = ("torchvision", "tvm_ffi")
STUB_VERSION = "0.0.0+kvstore.stub"


class _Placeholder(type):
    """A class whose every non-dunder attribute is another placeholder class."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = STUB_VERSION  # type: ignore[attr-defined]

        def attribute(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Placeholder(name, (), {})

        module.__getattr__ = attribute  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is its placeholders."""


def require_sglang() -> None:
    """Skip the calling test module, saying why and what to do, when SGLang cannot be imported here."""
    import pytest

    try:
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    except ImportError as exc:
        pytest.skip(
            f"SGLang 0.5.23 cannot be imported by {sys.executable} ({exc}); create its environment with "
            "`make venv-sglang` and run these tests with .venv-sglang/bin/python -m pytest tests/sglang",
            allow_module_level=True,
        )


def install() -> tuple[str, ...]:
    """Stub each of :data:`STUBBED` that is not installed; returns the ones stubbed. Idempotent."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return next(f.roots for f in sys.meta_path if isinstance(f, _StubFinder))
    missing = tuple(name for name in STUBBED if importlib.util.find_spec(name) is None)
    if missing:
        sys.meta_path.insert(0, _StubFinder(missing))
    return missing
