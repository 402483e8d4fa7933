"""A ``--workers`` group owns its port: a second group or server on it fails at start-up."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import requests

from tests.support import SRC, ServerProcess

Make = Callable[..., ServerProcess]


def _serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMETA_")}
    env["PYTHONPATH"] = str(SRC)
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def test_a_second_group_on_the_port_fails_naming_it(
    redis_url: str, make_server: Make, tmp_path: Path
) -> None:
    first = make_server("--backend", redis_url, "--workers", "2")
    first.wait_for_log("started 2 workers")
    port = first.port
    for other in (
        ["--backend", redis_url + "1", "--workers", "2"],  # another group, another backend
        ["--in-memory"],  # a single server
    ):
        result = _serve(*other, "--port", str(port), cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        assert "kvmeta listening" not in result.stderr
        assert f"port {port}" in result.stderr and f"sport = :{port}" in result.stderr
    # The first group still serves every connection, each worker logging its line.
    pids = set(re.findall(r"kvmeta listening on \S+ \(pid (\d+)\)", first.log))
    assert len(pids) == 2
    for _ in range(20):
        assert requests.get(first.url + "/health", timeout=10).ok


def test_a_group_cannot_join_a_single_server(
    make_server: Make, redis_url: str, tmp_path: Path
) -> None:
    single = make_server("--in-memory")
    result = _serve(
        "--backend", redis_url, "--workers", "2", "--port", str(single.port), cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr
    assert f"port {single.port}" in result.stderr
