"""Layers that only point down: no import cycle between prfaas's packages, none between its files.

Every module under prfaas/ is parsed with `ast`; every import counts, at module level, inside functions and under
`if TYPE_CHECKING:` alike, because an import moved into a function "to break a cycle" is still a cycle. A package
is the first level under prfaas/ (`prfaas.kv.format` belongs to `kv`); a top-level module such as `prfaas/config.py`
is a node of its own. The test names each cycle it finds: the strongly connected components of the package graph
and of the file graph.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "prfaas"

Graph = dict[str, set[str]]

# The ground floor kv, transfer, store and audit build on: the exception tree, wire limits, TLS context building,
# the store's records and the token bucket. Each imports nothing of prfaas but other ground modules.
GROUND = frozenset({"prfaas.errors", "prfaas.limits", "prfaas.tls", "prfaas.records", "prfaas.ratelimit"})

def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def resolve_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from ... import` names, relative levels resolved against `module`."""
    if node.level == 0:
        return node.module or ""
    anchor = module.split(".")
    anchor = anchor if is_package else anchor[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, node.module] if node.module else anchor)


def imported(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The prfaas modules one file imports: the named submodule where `from pkg import sub` names one."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_base(node, module, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in known else base


def file_graph() -> Graph:
    modules = all_modules()
    known = set(modules)
    graph: Graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = imported(tree, name, path.name == "__init__.py", known)
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(files: Graph) -> Graph:
    graph: Graph = {package_of(m): set() for m in files}
    for src, targets in files.items():
        graph[package_of(src)] |= {package_of(t) for t in targets} - {package_of(src)}
    return graph


def cycles(graph: Graph) -> list[tuple[str, ...]]:
    """Strongly connected components with more than one member (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []
    for start in sorted(graph):
        if start not in index:
            _strongconnect(graph, start, index, low, stack, on_stack, found)
    return sorted(found)


def _strongconnect(
    graph: Graph,
    start: str,
    index: dict[str, int],
    low: dict[str, int],
    stack: list[str],
    on_stack: set[str],
    found: list[tuple[str, ...]],
) -> None:
    work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
    _visit(start, index, low, stack, on_stack)
    while work:
        node, children = work[-1]
        child = next(children, None)
        if child is None:
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                found.extend(_pop_component(node, stack, on_stack))
        elif child not in index:
            _visit(child, index, low, stack, on_stack)
            work.append((child, iter(sorted(graph[child]))))
        elif child in on_stack:
            low[node] = min(low[node], index[child])


def _visit(node: str, index: dict[str, int], low: dict[str, int], stack: list[str], on_stack: set[str]) -> None:
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)


def _pop_component(root: str, stack: list[str], on_stack: set[str]) -> Iterable[tuple[str, ...]]:
    members: list[str] = []
    while True:
        member = stack.pop()
        on_stack.discard(member)
        members.append(member)
        if member == root:
            break
    return [tuple(sorted(members))] if len(members) > 1 else []


def describe(found: list[tuple[str, ...]], graph: Graph) -> str:
    """Each cycle with the edges inside it, so the failure says which import to move."""
    lines = []
    for members in found:
        inside = set(members)
        edges = [f"{a} -> {b}" for a in members for b in sorted(graph[a]) if b in inside]
        lines.append(f"cycle {{{', '.join(members)}}}: " + "; ".join(edges))
    return "\n".join(lines)


def test_no_package_cycle() -> None:
    graph = package_graph(file_graph())
    found = cycles(graph)
    assert not found, "import cycles between prfaas packages:\n" + describe(found, graph)


def test_no_file_cycle() -> None:
    graph = file_graph()
    found = cycles(graph)
    assert not found, "import cycles between prfaas files:\n" + describe(found, graph)


def test_ground_floor_imports_only_ground() -> None:
    graph = file_graph()
    above = {m: sorted(graph[m] - GROUND) for m in sorted(GROUND)}
    assert not any(above.values()), f"ground modules import from above the ground floor: {above}"


def test_checker_counts_lazy_guarded_and_relative_imports() -> None:
    """The checker itself: an import inside a function or under ``TYPE_CHECKING`` counts, a relative one is
    resolved, ``from pkg import name`` points at the package unless ``name`` is a module, and a cycle is found."""
    src = (
        "from typing import TYPE_CHECKING\nfrom . import b\nfrom prfaas.tool import helper\n"
        "if TYPE_CHECKING:\n    from prfaas.types import T\n"
        "def f() -> None:\n    from ..other import c\n"
    )
    known = {"prfaas.pkg.b", "prfaas.other.c", "prfaas.tool", "prfaas.types"}
    found = {m for m in imported(ast.parse(src), "prfaas.pkg.a", False, known) if m in known}
    assert found == known
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert package_of("prfaas.kv.format") == "kv" and package_of("prfaas.config") == "config"
