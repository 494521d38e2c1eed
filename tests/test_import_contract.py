"""The import contract between packages, checked on every import statement (module level or inside a function).

- kvstore's core (``kvstore/**``) imports neither ``engine`` nor ``connectors``:
  kvstore is a cache any engine can use, not part of one. Only the command
  line (``kvstore/cli``), the benchmarks (``kvstore/bench``) and the demo
  (``kvstore/demo.py``) build engines and connectors, so they may.
- ``kvstore/tiers`` does not import ``kvstore.daemon``: tiers are the storage
  the daemon is built from; the daemon as a tier lives in ``kvstore/daemon/tier.py``.
- Nothing installed (``kvstore``, ``engine``, ``connectors``) imports ``benchmarks``: the
  checkout's harnesses that drive other projects' environments are not part of
  the product, and a wheel does not carry them.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MAY_BUILD_ENGINES = ("kvstore/cli/", "kvstore/bench/", "kvstore/demo.py")


def _imported(path: Path) -> set[str]:
    """Every module named by an import statement in ``path``, with ``from a import b`` also giving ``a.b``."""
    return _imported_by(path.read_text(), path.relative_to(REPO).with_suffix("").parts[:-1], str(path))


def _imported_by(source: str, package: tuple[str, ...], filename: str) -> set[str]:
    """:func:`_imported` of ``source`` living in ``package`` (resolves relative imports)."""
    tree = ast.parse(source, filename=filename)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in files:
        for name in sorted(_imported(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(REPO)} imports {name}")
    return out


def _sources(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def test_kvstore_core_imports_neither_engine_nor_connectors() -> None:
    core = [p for p in _sources("kvstore") if not str(p.relative_to(REPO)).startswith(MAY_BUILD_ENGINES)]
    assert len(core) > 20  # the walk found the package
    assert _violations(core, ("engine", "connectors")) == []


def test_nothing_installed_imports_the_checkouts_benchmark_harnesses() -> None:
    installed = [p for folder in ("kvstore", "engine", "connectors") for p in _sources(folder)]
    assert _violations(installed, ("benchmarks",)) == []
    assert len(installed) > 100  # the walk found the packages


def test_tiers_do_not_import_the_daemon() -> None:
    tiers = _sources("kvstore/tiers")
    assert tiers
    assert _violations(tiers, ("kvstore.daemon",)) == []


def test_the_walk_sees_lazy_relative_and_from_imports() -> None:
    source = "def f():\n    from ..daemon import client\n    import engine.llm\n\nfrom kvstore import daemon\n"
    found = _imported_by(source, ("kvstore", "tiers"), "probe.py")
    assert found == {"kvstore.daemon", "kvstore.daemon.client", "engine.llm", "kvstore"}
