"""The import contract between packages, checked on every import statement (module level or inside a function).

- kvstore's core (``kvstore/**``) imports neither ``engine`` nor ``connectors``:
  kvstore is a cache any engine can use, not part of one. Only the command
  line (``kvstore/cli``, the demo included) and the benchmarks (``kvstore/bench``)
  build engines and connectors, so they may.
- ``kvstore/tiers`` does not import ``kvstore.daemon``: tiers are the storage
  the daemon is built from; the daemon as a tier lives in ``kvstore/daemon/client/tier.py``.
- ``kvstore/config`` does not import ``kvstore.daemon``: the config is read by everything, the daemon included; a
  bound both check (the largest frame before login) lives below both, in ``kvstore/frame_bounds.py``.
- The daemon's two ends stay apart: ``kvstore/daemon/client`` (what an engine imports) does not import
  ``kvstore.daemon.server`` and ``kvstore/daemon/server`` does not import ``kvstore.daemon.client``; both speak
  ``kvstore.daemon.wire``, which imports neither.
- The store core (``kvstore/store``) does not import ``kvstore.daemon``, not even through another module's
  eager imports: a daemon is one of the tiers below the store, reached through the ``Tier`` interface.
- ``kvstore/util`` imports nothing of ``kvstore``: its primitives sit below every layer that uses them.
- The ``kvstore`` package's import graph has no cycle, even counting imports under ``if TYPE_CHECKING:``.
- Nothing installed (``kvstore``, ``engine``, ``connectors``) imports ``benchmarks``: the
  checkout's harnesses that drive other projects' environments are not part of
  the product, and a wheel does not carry them.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MAY_BUILD_ENGINES = ("kvstore/cli/", "kvstore/bench/")


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


def test_the_config_does_not_import_the_daemon() -> None:
    config = _sources("kvstore/config")
    assert config
    assert _violations(config, ("kvstore.daemon",)) == []


def test_the_daemons_client_side_does_not_import_its_server_side() -> None:
    client = _sources("kvstore/daemon/client")
    assert len(client) >= 2
    assert _violations(client, ("kvstore.daemon.server",)) == []


def test_the_daemons_server_side_does_not_import_its_client_side() -> None:
    server = _sources("kvstore/daemon/server")
    assert len(server) >= 10
    assert _violations(server, ("kvstore.daemon.client",)) == []


def test_the_wire_imports_neither_end() -> None:
    wire = _sources("kvstore/daemon/wire")
    assert len(wire) >= 4
    assert _violations(wire, ("kvstore.daemon.client", "kvstore.daemon.server")) == []


def test_the_store_core_does_not_import_the_daemon() -> None:
    store = _sources("kvstore/store")
    assert len(store) >= 10
    assert _violations(store, ("kvstore.daemon",)) == []
    graph = _import_graph("kvstore")
    reached = _reachable(graph, {m for m in graph if m == "kvstore.store" or m.startswith("kvstore.store.")})
    assert sorted(m for m in reached if m.startswith("kvstore.daemon")) == []


def test_the_utilities_import_nothing_of_kvstore() -> None:
    util = _sources("kvstore/util")
    assert len(util) >= 5
    assert _violations(util, ("kvstore",)) == []


def test_the_walk_sees_lazy_relative_and_from_imports() -> None:
    source = "def f():\n    from ..daemon import client\n    import engine.llm\n\nfrom kvstore import daemon\n"
    found = _imported_by(source, ("kvstore", "tiers"), "probe.py")
    assert found == {"kvstore.daemon", "kvstore.daemon.client", "engine.llm", "kvstore"}


def _eager_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports when it is loaded or type-checked.

    That is every import at module level, in a class body, or under any ``if`` (``if TYPE_CHECKING:`` included) or
    ``try``; imports inside a function are left out: they run on first call, lazy by design (the daemon must not load
    torch while idle, ``kvstore --help`` must not pay for importing it). ``from a import b`` names ``a.b`` when that
    is a module, else ``a``.
    """
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    names: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text(), filename=str(path))]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            names.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return names & modules


def _import_graph(folder: str) -> dict[str, set[str]]:
    """Each module of the package in ``folder`` to the modules of that package it imports (:func:`_eager_imports`)."""
    paths = {}
    for path in _sources(folder):
        parts = path.relative_to(REPO).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: _eager_imports(path, set(paths)) - {name} for name, path in paths.items()}


def _reachable(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    """Every module that ``start`` imports, through any chain of :func:`_eager_imports`."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge of a depth-first walk of ``graph``: empty if and only if ``graph`` has no cycle."""
    done: set[str] = set()
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        path.append(v)
        for w in sorted(graph[v]):
            if w in path:
                cycles.append([*path[path.index(w) :], w])
            elif w not in done:
                visit(w)
        path.pop()
        done.add(v)

    for v in sorted(graph):
        if v not in done:
            visit(v)
    return cycles


def test_the_kvstore_package_has_no_import_cycle_even_under_type_checking() -> None:
    """No module of ``kvstore`` imports, through any chain, a module that imports it back.

    Imports under ``if TYPE_CHECKING:`` count: a cycle that only the type checker sees is still two modules that cannot
    be understood, tested or moved apart; what one needs from the other belongs to one owner (a Protocol declared by the
    module that uses it, or the fact moved to where both can import it). Imports inside functions do not count: they
    are lazy by design (see :func:`_eager_imports`) and run after both modules are loaded.
    """
    graph = _import_graph("kvstore")
    assert len(graph) > 20 and graph["kvstore"]  # the walk found the package and its imports
    cycles = _cycles(graph)
    for cycle in cycles:
        print(" -> ".join(cycle))
    assert cycles == []


def test_the_cycle_walk_finds_a_cycle_and_only_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
