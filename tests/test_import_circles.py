"""No import circles in the four packages, counting every import the source names.

The graph is read from the source with `ast`, nothing is imported: an edge for every `import` and
`from … import` at module level, inside a function and under `TYPE_CHECKING` alike. `from a.b import
c` is an edge to `a.b.c` when that is a module of ours, else to `a.b`; an import of `a.b.c` is an
edge to `a.b.c` only (the parent packages it runs are not counted, or every package `__init__` that
re-exports a submodule would close a circle with it).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "memory", "kvcache", "provider")


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name, for `__init__`)."""
    names: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that `module` names in any import statement anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, path, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif target in known:
                    found.add(target)
    found.discard(module)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    names = module_names(root)
    known = set(names)
    return {module: imports_of(module, path, known) for module, path in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest circle through each strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)

    found = []
    for component in components:
        members = set(component)
        start = component[0]
        # Breadth-first from start, inside the component, back to start: the shortest circle.
        previous: dict[str, str] = {}
        frontier = [start]
        closing = None
        while frontier and closing is None:
            following = []
            for node in frontier:
                for child in sorted(graph[node] & members):
                    if child == start:
                        closing = node
                        break
                    if child not in previous:
                        previous[child] = node
                        following.append(child)
                if closing is not None:
                    break
            frontier = following
        path = [closing]
        while path[-1] != start:
            path.append(previous[path[-1]])
        path.reverse()
        found.append(path + [start])
    return found


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    (tmp_path / "provider" / "sub").mkdir(parents=True)
    for package in PACKAGES[:3]:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "provider" / "__init__.py").write_text("")
    (tmp_path / "provider" / "sub" / "__init__.py").write_text("")
    (tmp_path / "provider" / "sub" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
    )
    (tmp_path / "provider" / "sub" / "b.py").write_text("def f():\n    from provider.sub import c\n")
    (tmp_path / "provider" / "sub" / "c.py").write_text("import provider.sub.a\n")
    graph = import_graph(tmp_path)
    assert graph["provider.sub.a"] == {"provider.sub.b"}
    assert graph["provider.sub.b"] == {"provider.sub.c"}
    assert graph["provider.sub.c"] == {"provider.sub.a"}
    assert cycles(graph) == [["provider.sub.a", "provider.sub.b", "provider.sub.c", "provider.sub.a"]]


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)
