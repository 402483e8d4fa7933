"""The package's shape: dependencies point one way, and every module says what it exports.

``core`` <- ``store`` <- ``service`` <- (``server``, ``client``, ``cli``): a module may import
only from its own layer or the layers below it (``errors``, ``_types`` and ``config`` are
shared leaves). Checked on the source, so a late import inside a function counts too.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import kvmeta

SRC = Path(kvmeta.__file__).parent

# Layer of each top-level part of the package; a module may import layers <= its own.
LAYERS = {
    "_types": 0,
    "errors": 0,
    "lograte": 0,
    "core": 1,
    "store": 2,
    "service": 3,
    "config": 3,
    "config_file": 3,
    "config_values": 3,
    "events": 3,
    "server": 4,
    "client": 4,
    "status": 5,
    "bench": 5,
    "cli": 6,
    "__main__": 6,
    "__init__": 6,
    "sglang": 5,
    "vllm": 5,
}
# Pairs in the same layer that must still not depend on each other.
FORBIDDEN_SAME_LAYER = {("server", "client"), ("client", "server")}


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _part(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def _imported_parts(path: Path) -> set[str]:
    parts: set[str] = set()
    package = ".".join(("kvmeta", *path.relative_to(SRC).with_suffix("").parts[:-1]))
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names = [".".join([*base, node.module or ""]).rstrip(".")]
            else:
                names = [node.module or ""]
        for name in names:
            bits = name.split(".")
            if bits[0] == "kvmeta" and len(bits) > 1:
                parts.add(bits[1])
    return parts


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down_the_layers(path: Path) -> None:
    own = _part(path)
    assert own in LAYERS, f"{own} has no layer: add it to LAYERS"
    for other in _imported_parts(path) - {own}:
        assert other in LAYERS, f"{other} has no layer: add it to LAYERS"
        assert LAYERS[other] <= LAYERS[own], f"{own} (layer {LAYERS[own]}) imports {other}"
        assert (own, other) not in FORBIDDEN_SAME_LAYER, f"{own} imports {other}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_every_module_declares_what_it_exports(path: Path) -> None:
    rel = path.relative_to(SRC).with_suffix("")
    if rel.name == "__main__" or path.name == "fsync_helper.py":
        return  # run as scripts, nothing to export
    name = ".".join(("kvmeta", *rel.parts)).removesuffix(".__init__")
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
