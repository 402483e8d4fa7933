"""mypy, with the project's configuration: strict on every module the configuration lists
(``[[tool.mypy.overrides]]`` in pyproject.toml), the default checks on the rest of ``src/``."""

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

# The layers whose every module must stay strict; others join as they become strict-clean.
_STRICT_AT_LEAST = {"kvmeta.core.*", "kvmeta.store.*", "kvmeta.errors", "kvmeta.config"}


def test_the_strict_modules_are_configured_strict() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    if config.get("strict"):
        return
    strict = [o for o in config.get("overrides", []) if o.get("disallow_untyped_defs")]
    modules = {m for o in strict for m in o["module"]}
    assert _STRICT_AT_LEAST <= modules
    (flags,) = strict
    for flag in ("disallow_any_generics", "warn_return_any", "strict_equality", "extra_checks"):
        assert flags.get(flag) is True, flag
    assert flags.get("implicit_reexport") is False


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
