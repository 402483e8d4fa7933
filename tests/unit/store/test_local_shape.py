"""The local backend's shape: a durable reserve reads top to bottom (LocalBackend -> the
write-ahead rule -> MemoryStore -> Pool / Journal), and the store never calls back up."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
from pathlib import Path
from types import ModuleType

import kvmeta

ROOT = Path(__file__).resolve().parents[3]
DISK = Path(kvmeta.__file__).resolve().parent / "store" / "disk"


def _counter() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "count_boundaries", ROOT / "benchmarks" / "count_boundaries.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_durable_reserve_that_evicts_crosses_at_most_ten_store_files() -> None:
    """Counted as ``benchmarks/count_boundaries.py`` does (calls from a file under store/ into
    another file of the store or of core; the pool model's calls between its own files are
    not store boundaries), for a reserve that tops up its spare and one that evicts on the
    spot and waits for the disk."""
    counter = _counter()
    for name, pages in counter.SCENARIOS.items():
        crossings = asyncio.run(counter.count(pages, False))
        calls = [
            f"{src} -> {dst}"
            for event, src, dst in crossings
            if event == "call" and src.startswith("store/")
        ]
        assert len(calls) <= 10, f"{name}: {len(calls)} calls out of a store file: {calls}"


def _runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it runs (not those under ``if TYPE_CHECKING``)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_store_and_the_rule_import_nothing_above_them() -> None:
    above = {"kvmeta.store.disk.local", "kvmeta.store.disk.datadir"}
    assert not _runtime_imports(DISK / "memory.py") & (above | {"kvmeta.store.disk.writeahead"})
    assert not _runtime_imports(DISK / "writeahead.py") & (above | {"kvmeta.store.disk.memory"})
