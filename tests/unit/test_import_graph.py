"""No import cycles among the modules of libs/, services/ and benchmarks/, `TYPE_CHECKING` imports
and imports inside functions included (grimp reads them all), and no import the graph cannot see.

import-linter's contracts check layers and the packages of libs; this checks every module."""

import ast
import sys
import textwrap
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("libs", "services", "benchmarks")

# Imports allowed to close a cycle, until the work named removes them: keep this list short, and
# delete an entry with the import (test_known_cycle_edges_still_close_a_cycle says when).
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {
}


def import_graph(*packages: str) -> grimp.ImportGraph:
    return grimp.build_graph(*packages, include_external_packages=False, cache_dir=None)


def cycles(graph: grimp.ImportGraph, allowed: set[tuple[str, str]] = frozenset()) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), the edges in ALLOWED
    left out; each sorted, the list sorted."""
    edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if (m, i) not in allowed)
             for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursive: the graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                found.append(sorted([v, *component]))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges)))
    try:
        for module in sorted(edges):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def describe(graph: grimp.ImportGraph, component: list[str]) -> str:
    """A cycle's imports, with the line of each."""
    members = set(component)
    lines = []
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            for d in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"  {importer}:{d['line_number']}: {d['line_contents']}")
    return "\n".join(lines)


def test_no_import_cycles():
    graph = import_graph(*PACKAGES)
    found = cycles(graph, set(KNOWN_CYCLE_EDGES))
    assert not found, "import cycles:\n" + "\n\n".join(describe(graph, c) for c in found)


def test_known_cycle_edges_still_close_a_cycle():
    graph = import_graph(*PACKAGES)
    stale = [f"{a} -> {b}" for a, b in KNOWN_CYCLE_EDGES
             if not graph.direct_import_exists(importer=a, imported=b)
             or graph.find_shortest_chain(importer=b, imported=a) is None]
    assert not stale, f"no longer a cycle: delete from KNOWN_CYCLE_EDGES: {stale}"


def test_a_cycle_closed_only_under_type_checking_is_found(tmp_path, monkeypatch):
    """The checker's own check: grimp counts TYPE_CHECKING imports and imports inside functions."""
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "service.py").write_text("from cyclepkg.part import Part\n")
    (pkg / "part.py").write_text(textwrap.dedent("""\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from cyclepkg.service import Service
        """))
    (pkg / "lazy.py").write_text("def f():\n    from cyclepkg import late\n")
    (pkg / "late.py").write_text("import cyclepkg.lazy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = import_graph("cyclepkg")
    assert cycles(graph) == [["cyclepkg.late", "cyclepkg.lazy"], ["cyclepkg.part", "cyclepkg.service"]]
    assert cycles(graph, {("cyclepkg.part", "cyclepkg.service"), ("cyclepkg.late", "cyclepkg.lazy")}) == []


def hidden_imports(path: Path) -> list[str]:
    """Calls of importlib.import_module / __import__ with a name written out: an import between our
    modules that no import graph sees. (A module's own children by `f"{__name__}..."` are fine.)"""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name not in ("import_module", "__import__"):
            continue
        arg = node.args[0]
        relative_to_self = (isinstance(arg, ast.JoinedStr) and arg.values
                            and isinstance(arg.values[0], ast.FormattedValue)
                            and isinstance(arg.values[0].value, ast.Name) and arg.values[0].value.id == "__name__")
        if not relative_to_self:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_hidden_from_the_graph(package):
    hidden = [h for f in sorted((ROOT / package).rglob("*.py")) for h in hidden_imports(f)]
    assert not hidden, "write these as imports (or, across layers, as an entry point):\n" + "\n".join(hidden)
