"""No import cycles between the modules of the ``kvserve`` package.

Every module (found with ``pkgutil`` over the package's folder, nothing
imported) is parsed with ``ast``; every ``import`` / ``from ... import`` of
a ``kvserve`` module counts, wherever it is: at the top, inside a function
(the usual way a cycle is hidden), under ``if TYPE_CHECKING:`` (a type-only
cycle still ties two designs together; a ``Protocol`` breaks it), relative
or absolute. ``from kvserve.cpu import ops`` is an edge to the module
``kvserve.cpu.ops``; ``from kvserve.cpu.ops import CpuOps`` one to
``kvserve.cpu.ops``. A parent package is not an implicit edge.

A cycle fails the test with its modules in order, e.g.
``kvserve.a -> kvserve.b -> kvserve.a``. To break one, move what both need
into a module below them, or invert a dependency (a registry, a Protocol).
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import kvserve

PACKAGE = "kvserve"


def package_modules(path: list[str], prefix: str = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """``{module name: (source file, is a package)}`` of the package at
    ``path`` and everything below it (``pkgutil.iter_modules``, recursively;
    no module is imported)."""
    modules = {prefix: (Path(path[0]) / "__init__.py", True)}
    for info in pkgutil.iter_modules(path):
        name = f"{prefix}.{info.name}"
        folder = Path(info.module_finder.path)
        if info.ispkg:
            modules.update(package_modules([str(folder / info.name)], name))
        else:
            modules[name] = (folder / f"{info.name}.py", False)
    return modules


def module_imports(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The ``known`` modules that ``module``'s ``source`` imports anywhere in
    its body (see the module doc); ``is_package``: it is an ``__init__``,
    which relative imports resolve against."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(_closest(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in known else _closest(base, known))
    found.discard(None)
    found.discard(module)
    return found


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The absolute module name a ``from`` import reads from."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[:len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _closest(name: str, known: set[str]) -> str | None:
    """``name`` or its nearest enclosing module among ``known`` (None: not ours)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the whole ``kvserve`` package."""
    modules = package_modules(list(kvserve.__path__))
    known = set(modules)
    return {name: module_imports(path.read_text(encoding="utf-8"), name, is_package, known)
            for name, (path, is_package) in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of
    more than one module, sorted."""
    return sorted(_cycle_in(graph, component) for component in tangles(graph))


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: the
    modules that import each other, directly or not (Tarjan's algorithm,
    iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in the component {sorted(component)}")


def test_the_kvserve_package_has_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and "kvserve.engine" in graph  # the walk found the package
    lines = [f"{' -> '.join(_cycle_in(graph, c))}   (modules in the tangle: "
             f"{', '.join(sorted(c))})" for c in tangles(graph)]
    assert not lines, "import cycles:\n" + "\n".join(sorted(lines))


def test_imports_inside_functions_relative_and_type_only_are_edges():
    known = {"kvserve", "kvserve.a", "kvserve.a.b", "kvserve.a.c", "kvserve.d", "kvserve.e",
             "kvserve.f"}
    source = "\n".join([
        "import numpy",
        "from typing import TYPE_CHECKING",
        "from . import c",                      # relative: kvserve.a.c
        "from .. import d",                     # kvserve.d
        "if TYPE_CHECKING:",
        "    from kvserve.e import Thing",      # a name in a module: kvserve.e
        "def f():",
        "    import kvserve.f.missing",         # the nearest known module
    ])
    assert module_imports(source, "kvserve.a.b", False, known) == {
        "kvserve.a.c", "kvserve.d", "kvserve.e", "kvserve.f"}
    init = "from .b import X\nfrom . import c\n"
    assert module_imports(init, "kvserve.a", True, known) == {"kvserve.a.b", "kvserve.a.c"}


def test_a_cycle_is_found_and_named_in_order():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"x": {"y"}, "y": {"x"}, "z": {"w"}, "w": {"z"}}) == [
        ["w", "z", "w"], ["x", "y", "x"]]


def test_the_model_does_not_probe_its_backend():
    """Issue 49, item 2: the model layer asks the backend through declared
    ``Ops`` members (``xp``, ``decode_path``, ``decode_layers``), never by
    probing it with ``getattr(ops, ...)``."""
    import re

    src = Path(__file__).resolve().parents[1] / "src"
    probes = [f"{path.relative_to(src)}:{n}"
              for path in sorted((src / "model").rglob("*.py"))
              for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
              if re.search(r"getattr\((self\.)?ops\b", line)]
    assert probes == []


def test_the_model_and_the_actors_do_not_import_distributed():
    """Issue 49, item 3: the model layer and the actors run on one node; the
    scale-out package (replicas, pipeline and tensor parallelism) builds on
    them, never the other way round. The KV offload tiers they use live in
    ``kvserve.kv_offload``."""
    graph = import_graph()
    arrows = sorted(f"{a} -> {b}" for a, targets in graph.items()
                    if a.startswith(("kvserve.model.", "kvserve.actors."))
                    for b in targets
                    if b == "kvserve.distributed" or b.startswith("kvserve.distributed."))
    assert arrows == [], "arrows into kvserve.distributed:\n" + "\n".join(arrows)
