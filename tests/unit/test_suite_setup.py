"""The test suite's own set-up: what scripts/test and CI rely on. The suite runs in pytest-xdist
workers, which must collect the same test ids; soak tests stay out of a developer's run but
stay runnable; every tool the suite runs with is pinned, so CI runs what a developer ran."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest
from tests.support import SRC

ROOT = SRC.parent

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the lowest Python
    import tomli as tomllib


def _pytest(*argv: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *map(str, argv)],
        capture_output=True, text=True, cwd=cwd, timeout=120,
    )  # fmt: skip


def _names(lines: list[str]) -> set[str]:
    """Distribution names of requirement or pin lines, normalised as pip compares them."""
    found = set()
    for line in lines:
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#", 1)[0])
        if name:
            found.add(re.sub(r"[-_.]+", "-", name.group(1)).lower())
    return found


def test_route_ids_are_the_same_in_every_worker() -> None:
    """Before the ids were given, each process named these tests after function addresses, and
    a second xdist worker refused the run ("Different tests were collected")."""
    done = _pytest("--collect-only", "-q", "tests/unit/test_route_handlers.py")
    assert done.returncode == 0, done.stdout + done.stderr
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids and not [i for i in ids if " at 0x" in i], ids


class _Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid


def test_an_id_carrying_an_address_is_refused_at_collection() -> None:
    fine = [_Item("tests/unit/test_x.py::test_y[POST /v1/pools]")]
    conftest.pytest_collection_modifyitems(fine)  # type: ignore[arg-type]
    bad = fine + [_Item("tests/unit/test_x.py::test_y[<function f at 0x7f63cf770d60>]")]
    with pytest.raises(pytest.UsageError, match=r"1 test id.*test_y\[<function f.*ids="):
        conftest.pytest_collection_modifyitems(bad)  # type: ignore[arg-type]


def test_soak_tests_are_left_out_unless_asked_for(tmp_path: Path) -> None:
    (tmp_path / "test_soaked.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.soak\ndef test_long() -> None:\n    pass\n\n"
        "def test_short() -> None:\n    pass\n"
    )
    config = ("-c", ROOT / "pyproject.toml", "--rootdir", tmp_path, "--collect-only", "-q")
    default = _pytest(*config, tmp_path / "test_soaked.py", cwd=tmp_path)
    assert default.returncode == 0, default.stdout + default.stderr
    assert "test_short" in default.stdout and "test_long" not in default.stdout, default.stdout
    assert "1 deselected" in default.stdout, default.stdout
    soak = _pytest(*config, "-m", "soak", tmp_path / "test_soaked.py", cwd=tmp_path)
    assert soak.returncode == 0, soak.stdout + soak.stderr
    assert "test_long" in soak.stdout and "test_short" not in soak.stdout, soak.stdout


def test_every_test_tool_is_pinned_and_the_workers_plugin_is_one() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = _names(project["optional-dependencies"]["test"])
    pinned = _names((ROOT / "constraints" / "test.txt").read_text().splitlines())
    assert not extra - pinned, f"not pinned in constraints/test.txt: {sorted(extra - pinned)}"
    # scripts/test runs the suite with `-n` in both venvs: the plugin and its transport.
    assert "pytest-xdist" in extra
    lowest = _names((ROOT / "constraints" / "lowest.txt").read_text().splitlines())
    assert {"pytest-xdist", "execnet"} <= pinned & lowest


def test_the_long_files_exist_and_start_first() -> None:
    missing = [path for path in conftest.LONG_FILES if not (ROOT / path).is_file()]
    assert not missing, f"tests/conftest.py LONG_FILES names files that are gone: {missing}"
    last, first = conftest.LONG_FILES[-1], conftest.LONG_FILES[0]
    items = [_Item("tests/unit/test_a.py::test_1"), _Item(f"{last}::test_2")]
    items += [_Item("tests/unit/test_a.py::test_3"), _Item(f"{first}::test_4")]
    conftest.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.nodeid.rsplit("_", 1)[1] for i in items] == ["4", "2", "1", "3"]
