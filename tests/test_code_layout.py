"""How the product code hangs together: no import circles between megarl's modules (counting the imports inside
functions too: a circle there is one module's job split over two), the packages in one order from the ground floor
up with no import running back down-to-up (`PACKAGE_ORDER`), the product never importing the `converters/` entry
points, and `megarl/testing/` for tests and benchmarks only (product code that imports a fixture ships a test helper
as a feature)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
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


PACKAGE_ORDER: list[tuple[str, ...]] = [
    ("errors", "config"),  # what a user did wrong; the config machinery: loader, schema, paths, suggestions, dump
    ("data",),  # the Batch and the datasets: records, prompts, tokenizers, packing
    ("runtime",),  # devices, torch.distributed, processes, progress bars, stage layouts
    (
        "models",
        "bridge",
        "checkpoint",
        "algorithms",
        "rewards",
    ),  # Megatron models, HF <-> Megatron, checkpoints, losses
    ("conversion", "cluster"),  # `megarl convert`'s library; Ray worker groups
    ("rollout", "workers", "agents"),  # the rollout engines, the Ray workers of each role, multi-turn episodes
    ("plan",),  # will a job fit: memory, placement, weight-sync time
    ("trainer",),  # the loops, the controller's rollout side, observability, a run's life cycle
    ("job",),  # megarl/job.py: every section's config nested into one job config
    ("plan_command", "cli", "testing"),  # the `megarl` command; fixtures for tests and benchmarks
]
"""megarl's packages from the ground floor up (`megarl.X` or the module `megarl/X.py`). A module may import from
its own floor and any floor below, never from one above (imports inside functions count; imports under
`if TYPE_CHECKING:` are annotations and do not)."""

ALLOWED_UPWARD = {
    (
        "megarl",
        "megarl.runtime",
    ): "the package root (megarl/__init__.py) installs the lazy torch.compile before Megatron loads",
}
"""Imports that run up the order on purpose, each with its reason."""


def _floor(module: str) -> int:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else parts[0]
    for floor, names in enumerate(PACKAGE_ORDER):
        if name in names:
            return floor
    raise AssertionError(f"{module}: package {name!r} is on no floor of PACKAGE_ORDER; add it there")


def _runtime_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every absolute import that runs, at module or function level: not those under
    `if TYPE_CHECKING:`."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _upward_imports(package: Path = PACKAGE) -> list[str]:
    upward = []
    for path in sorted(package.rglob("*.py")):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        for line, target in _runtime_imports(ast.parse(path.read_text())):
            if target.split(".")[0] != package.name or (name, target) in ALLOWED_UPWARD:
                continue
            if _floor(target) > _floor(name):
                upward.append(f"{path.relative_to(package.parent)}:{line} imports {target}")
    return upward


def test_no_import_runs_up_the_package_order():
    assert _upward_imports() == []


def test_every_package_is_on_a_floor():
    packages = {path.stem for path in PACKAGE.iterdir() if path.suffix == ".py" or (path / "__init__.py").exists()}
    placed = {name for names in PACKAGE_ORDER for name in names}
    assert sorted(packages - placed - {"__init__"}) == []


def test_the_order_check_finds_an_upward_import(tmp_path):
    package = tmp_path / "megarl"
    (package / "config").mkdir(parents=True)
    (package / "config" / "loader.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megarl.job import JobConfig\n"
        "def load():\n    from megarl.trainer.lifecycle import run\n"
    )
    assert _upward_imports(package) == ["megarl/config/loader.py:5 imports megarl.trainer.lifecycle"]


def test_product_code_does_not_import_the_converters_folder():
    importers = sorted(
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*.py")
        if any(target.split(".")[0] == "converters" for _, target in _runtime_imports(ast.parse(path.read_text())))
    )
    assert importers == []


def test_only_megarl_is_installed():
    """No generic top-level package (`converters`) lands in site-packages next to megarl."""
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["include"] == ["megarl*"]


def test_the_driver_loads_a_job_without_torch_and_trains_without_megatron():
    """`megarl train` checks the config before anything heavy (torch would hold Ray's start back by 2 s), and the
    driver never imports Megatron-Core (3-4 s of a 2-core machine's start-up): only the workers build models."""
    code = (
        "import sys; from megarl.config import load_config; from megarl.job import JobConfig; "
        "load_config(JobConfig, 'configs/quickstart.yaml'); print(sorted({'torch', 'ray'} & set(sys.modules))); "
        "import megarl.cli, megarl.trainer.lifecycle.run, megarl.trainer.lifecycle.preflight as p; "
        "p.preflight(load_config(JobConfig, 'configs/quickstart.yaml', ['model.path=/nonexistent']), "
        "check_memory=True, off_machine=True); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'sglang')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["[]", "[]"], out.stderr[-2000:]
