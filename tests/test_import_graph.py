"""gpunode's import graph, read from the source: no cycles, and errors.py a leaf.

Every import counts wherever it is written: at module level, under `if TYPE_CHECKING:`, or inside a
function. An import deferred into a function still makes the two modules depend on each other; it only
moves the failure from import time to the first call, so hiding one there must not make a cycle pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "gpunode"


def _modules(root: Path) -> dict[str, Path]:
    """Every module of the package under `root`, by dotted name (a package by its own name)."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _targets(name: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The package's modules an import statement in module `name` names.

    As import-linter's graph (grimp) counts them: `import a.b.c` and `from a.b import c` (c a module) need
    a.b.c; `from a.b import name` needs a.b. The packages above (a, a.b) are run by Python first as well,
    but that is not a need of this module's: counting it would put every module imported from outside a
    package in a cycle with any part of the package that its __init__ imports in a function."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            # A relative import counts from the module's package (a package's __init__ is its own package).
            package = name.split(".") if _is_package(name, modules) else name.split(".")[:-1]
            anchor = package[: len(package) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        wanted = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
        ]
    found: set[str] = set()
    for target in wanted:
        parts = target.split(".")
        # The module itself, else the nearest package of ours above it (`import gpunode.x.missing` fails
        # at run time, but still names gpunode.x).
        module = next(
            (".".join(parts[:end]) for end in range(len(parts), 0, -1) if ".".join(parts[:end]) in modules),
            None,
        )
        if module is not None and module != name:
            found.add(module)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports, from every import statement in its source."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _targets(name, node, modules)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) for each strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(start: str) -> None:
        # Tarjan's algorithm, iterative so that a deep graph cannot hit the recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component: set[str] = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)

    found: list[list[str]] = []
    for component in components:
        start = min(component)
        if len(component) == 1:
            continue  # a module is never its own edge (_targets leaves it out)
        # The shortest way back to `start` inside the component: the cycle named in the failure.
        paths = {start: [start]}
        frontier = [start]
        cycle: list[str] | None = None
        while frontier and cycle is None:
            following: list[str] = []
            for node in frontier:
                for succ in sorted(graph[node] & component):
                    if succ == start:
                        cycle = [*paths[node], start]
                        break
                    if succ not in paths:
                        paths[succ] = [*paths[node], succ]
                        following.append(succ)
                if cycle is not None:
                    break
            frontier = following
        assert cycle is not None
        found.append(cycle)
    return found


def test_gpunode_has_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    found = cycles(graph)
    lines = []
    for cycle in found:
        # A cycle is one way round; the other modules that the same knot ties together are named too.
        tied = _reaches(graph, cycle[0]) & {m for m in graph if cycle[0] in _reaches(graph, m)}
        others = sorted(tied - set(cycle))
        lines.append(" -> ".join(cycle) + (f" (and in the same knot: {', '.join(others)})" if others else ""))
    assert not found, "import cycles (move what both sides need into a leaf module):\n" + "\n".join(lines)


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen = {start}
    todo = [start]
    while todo:
        for succ in graph[todo.pop()]:
            if succ not in seen:
                seen.add(succ)
                todo.append(succ)
    return seen


def test_errors_imports_nothing_of_gpunode() -> None:
    # Every module raises gpunode's errors: errors.py importing any of them would be a cycle in waiting.
    assert import_graph(PACKAGE)["gpunode.errors"] == set()


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/leaf.py": "import json\n",
            "pkg/a.py": "from pkg.b import thing\n",
            # Deferred into a function, and relative: still an edge back to a.
            "pkg/b.py": "thing = 1\ndef later():\n    from . import a\n    return a\n",
            "pkg/sub/__init__.py": "from pkg.sub import inner\n",
            "pkg/sub/inner.py": "from ..leaf import json\n",
            # Only for the type checker: still a dependency.
            "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n",
            "pkg/d.py": "import pkg.sub.inner\nfrom pkg import c\n",
        },
    )
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.sub.inner"] == {"pkg.leaf"}
    assert graph["pkg.sub"] == {"pkg.sub.inner"}
    assert graph["pkg.d"] == {"pkg.sub.inner", "pkg.c"}
    assert graph["pkg.leaf"] == set()
    assert sorted(cycles(graph)) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.d", "pkg.c"]]


def test_a_longer_cycle_is_named_in_order(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/x.py": "import pkg.y\n",
            "pkg/y.py": "def f():\n    import pkg.z\n",
            "pkg/z.py": "from pkg import x\n",
        },
    )
    assert cycles(import_graph(package)) == [["pkg.x", "pkg.y", "pkg.z", "pkg.x"]]
