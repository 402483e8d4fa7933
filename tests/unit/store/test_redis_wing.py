"""The Redis wing's shape: modules small enough to read whole, named for what they hold, and
imports between them pointing one way, ``backend`` on top (nothing in the wing imports it)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvmeta.store.redis

WING = Path(kvmeta.store.redis.__file__).parent
PACKAGE = "kvmeta.store.redis"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(WING.glob("*.py")) if p.stem != "__init__"}


def _wing_imports(path: Path) -> set[str]:
    """The wing's modules ``path`` imports (a late import inside a function counts too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = node.module
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        for name in names:
            if name.startswith(PACKAGE + "."):
                found.add(name.removeprefix(PACKAGE + ".").split(".")[0])
    return found - {path.stem}


def test_no_module_of_the_wing_is_over_600_lines() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_imports_inside_the_wing_point_one_way() -> None:
    graph = {name: _wing_imports(path) & set(_modules()) for name, path in _modules().items()}
    assert not [name for name, deps in graph.items() if "backend" in deps]
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())
    # The call loop is the base the other parts of the backend build on, not one of them.
    assert not graph["calls"] & {"probes", "hidx_build", "stats"}
