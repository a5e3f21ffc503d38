"""How the product code hangs together: no import circles between megarl's modules (counting the imports inside
functions too: a circle there is one module's job split over two), and `megarl/testing/` is for tests and
benchmarks only (product code that imports a fixture ships a test helper as a feature)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megarl"


def _import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return circles


def test_no_import_circles():
    assert _circles(_import_graph()) == []


def test_the_circle_finder_finds_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_product_code_does_not_import_test_helpers():
    graph = _import_graph()
    importers = sorted(
        name
        for name, targets in graph.items()
        if not name.startswith("megarl.testing") and any(t.startswith("megarl.testing") for t in targets)
    )
    assert importers == []
