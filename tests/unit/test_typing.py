"""mypy, with the project's configuration: ``strict`` on all of ``src/``, and no override that
takes a module out of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mypy (a test dependency) brings tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]

# Settings that would exempt modules from a check strict mode makes.
_LOOSENING = {
    "ignore_errors": True,
    "disallow_untyped_defs": False,
    "disallow_incomplete_defs": False,
    "disallow_any_generics": False,
    "warn_return_any": False,
    "check_untyped_defs": False,
    "strict": False,
}


def test_all_of_src_is_type_checked_strictly() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config.get("strict") is True
    for override in config.get("overrides", []):
        loosened = {k: v for k, v in override.items() if _LOOSENING.get(k, not v) == v}
        assert not loosened, f"{override['module']} is exempted from strict checks: {loosened}"


@pytest.mark.slow
def test_mypy_passes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "src/kvmeta", "--ignore-missing-imports"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
