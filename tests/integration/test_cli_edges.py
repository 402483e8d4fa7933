"""The ``kvmeta`` command at its edges, as a user meets them in a shell: a ``--url`` typed
without its scheme, output piped into ``head``, flags that contradict each other, misspelt
``KVMETA_*`` variables, and ``kvmeta check`` pointed at a directory kvmeta never wrote.

Real processes throughout: each command runs as ``python -m kvmeta`` with this checkout's source.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmeta.cli import _run
from tests.support import ServerProcess, child_env


def kvmeta(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", *args],
        capture_output=True,
        text=True,
        env={**child_env(), **(env or {})},
        timeout=timeout,
    )


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# --url without a scheme -------------------------------------------------------------------


def test_status_reads_host_port_as_http(make_server: Callable[..., ServerProcess]) -> None:
    server = make_server("--in-memory")
    host_port = server.url.removeprefix("http://")
    done = kvmeta("status", "--url", host_port)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert f"at http://{host_port}: ready" in done.stdout.splitlines()[0]


def test_status_refuses_a_url_it_cannot_use_in_one_line_without_the_token() -> None:
    done = kvmeta("status", "--url", "ftp://:sekrit@127.0.0.1:1")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "sekrit" not in done.stderr
    [line] = _lines(done.stderr)
    assert line.startswith("kvmeta: error: --url must be http://") and "ftp://:***@" in line


def test_bench_reads_host_port_as_http(make_server: Callable[..., ServerProcess]) -> None:
    server = make_server("--in-memory", "--read-lease", "0")
    host_port = server.url.removeprefix("http://")
    common = ("--clients", "1", "--requests", "20", "--warmup", "0", "--pool-pages", "512")
    done = kvmeta("bench", "--url", host_port, *common, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["config"]["url"] == server.url
    assert report["requests"] >= 20


# output into a pipe whose reader has gone (`| head -1`) ----------------------------------


def _into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvmeta ARGS`` with stdout a pipe whose reading end is closed before it starts: the
    first write fails as it does once ``head -1`` has read its line and exited."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "kvmeta", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            timeout=120,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "extra", [(), ("--json",), ("--watch", "0.1")], ids=["table", "json", "watch"]
)
def test_status_into_a_closed_pipe_exits_quietly(
    make_server: Callable[..., ServerProcess], extra: tuple[str, ...]
) -> None:
    server = make_server("--in-memory")
    done = _into_closed_pipe("status", "--url", server.url, *extra)
    assert done.stderr == ""
    assert done.returncode == 0


def test_a_broken_pipe_other_than_stdout_stays_an_error() -> None:
    def command(args: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe")  # e.g. a socket the server closed

    with pytest.raises(BrokenPipeError):
        _run(argparse.Namespace(func=command))


def test_check_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    done = _into_closed_pipe("check", "--data-dir", str(tmp_path / "missing"))
    [line] = _lines(done.stderr)  # the problem (stderr), and nothing about the pipe
    assert line.startswith("PROBLEM: ")
    assert done.returncode == 0


# flags that contradict each other --------------------------------------------------------


def test_serve_in_memory_with_a_data_dir_refuses_in_one_line(tmp_path: Path) -> None:
    data = tmp_path / "state"
    done = kvmeta("serve", "--in-memory", "--data-dir", str(data), "--port", "0", timeout=60)
    assert done.returncode == 2
    [line] = _lines(done.stderr)
    assert line.startswith("kvmeta: error: `--in-memory` conflicts with `--data-dir`"), line
    assert not data.exists()


# misspelt KVMETA_* variables ----------------------------------------------------------------


def _warned(text: str) -> list[str]:
    return [line for line in text.splitlines() if "is not a kvmeta setting" in line]


def test_serve_warns_about_each_unknown_variable_and_starts(
    make_server: Callable[..., ServerProcess],
) -> None:
    env = {
        "KVMETA_READ_LEASES": "1",
        "KVMETA_AUTH_TOKN": "value-never-shown",
        "KVMETA_TEST_CACHE": "/nowhere",  # the test suite's own: not a server setting
        "KVMETA_HOST": "127.0.0.1",  # a real one
    }
    server = make_server("--in-memory", env=env)
    warned = _warned(server.log)
    assert len(warned) == 2, server.log
    assert warned[0].endswith(
        "KVMETA_AUTH_TOKN is not a kvmeta setting (did you mean KVMETA_AUTH_TOKEN?)"
    )
    assert warned[1].endswith(
        "KVMETA_READ_LEASES is not a kvmeta setting (did you mean KVMETA_READ_LEASE?)"
    )
    assert "value-never-shown" not in server.log
    assert server.post("/0/initialize", {"num_pages": 4}).status_code == 204  # it carried on


def test_status_warns_about_an_unknown_variable_and_carries_on(
    make_server: Callable[..., ServerProcess],
) -> None:
    server = make_server("--in-memory")
    done = kvmeta("status", "--url", server.url, env={"KVMETA_AUTH_TOKN": "t"})
    assert done.returncode == 0, done.stderr
    assert _lines(done.stderr) == [
        "kvmeta: warning: KVMETA_AUTH_TOKN is not a kvmeta setting (did you mean "
        "KVMETA_AUTH_TOKEN?)"
    ]
    assert "ready" in done.stdout


# kvmeta check on a directory kvmeta never wrote ---------------------------------------------


@pytest.mark.parametrize("contents", [["hosts", "passwd"], []], ids=["other-files", "empty"])
def test_check_refuses_a_directory_without_kvmeta_files(
    tmp_path: Path, contents: list[str]
) -> None:
    directory = tmp_path / "etc"
    directory.mkdir()
    for name in contents:
        (directory / name).write_text("not kvmeta's\n")
    done = kvmeta("check", "--data-dir", str(directory))
    assert done.returncode == 1
    [line] = _lines(done.stderr)
    assert line.startswith(f"PROBLEM: {directory} is not a kvmeta data directory"), line
    for looked_for in ("journal-*.log", "snapshot-*.snap", "EPOCH", "LOCK"):
        assert looked_for in line
    assert "ok" not in done.stdout.split()
    assert sorted(p.name for p in directory.iterdir()) == sorted(contents)  # nothing created


def test_check_refuses_a_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    done = kvmeta("check", "--data-dir", str(missing))
    assert done.returncode == 1
    [line] = _lines(done.stderr)
    assert line.startswith(f"PROBLEM: {missing} does not exist"), line
    assert not missing.exists()


def test_check_passes_the_directory_a_server_made_even_without_pools(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = ServerProcess("--data-dir", str(data), cwd=tmp_path).start()
    assert server.stop() == 0  # SIGTERM: a clean stop
    done = kvmeta("check", "--data-dir", str(data))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    assert done.stdout.splitlines()[-1] == "ok"
    assert "total: 0 pools, 0 stored keys" in done.stdout
