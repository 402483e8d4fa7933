"""``kvmeta serve`` refuses bad numbers and taken ports with one clear line, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.redis_support import RedisServer
from tests.support import SRC


def _serve(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVMETA_")}
    full["PYTHONPATH"] = str(SRC)
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=full,
        stdin=subprocess.DEVNULL,
    )


def _one_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr
    return errors[0]


@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        (["--port", "70000"], {}, ["--port", "KVMETA_PORT", "0..65535"]),
        (["--port", "-1"], {}, ["--port", "KVMETA_PORT", "0..65535"]),
        ([], {"KVMETA_PORT": "65536"}, ["env KVMETA_PORT", "0..65535"]),
        (["--reservation-ttl", "0"], {}, ["--reservation-ttl", "> 0"]),
        (["--reservation-ttl", "nan"], {}, ["--reservation-ttl", "finite"]),
        (["--read-lease", "-1"], {}, ["--read-lease", ">= 0"]),
        (["--fsync-interval", "0"], {}, ["--fsync-interval", "> 0"]),
        (["--snapshot-interval", "inf"], {}, ["--snapshot-interval", "finite"]),
        (["--header-timeout", "0"], {}, ["--header-timeout", "> 0"]),
        (["--max-connections", "0"], {}, ["--max-connections", "> 0"]),
    ],
)
def test_bad_numbers_are_one_line_naming_the_flag(
    tmp_path: Path, args: list[str], env: dict[str, str], needles: list[str]
) -> None:
    line = _one_error(_serve("--in-memory", *args, cwd=tmp_path, env=env))
    for needle in needles:
        assert needle in line, line


def _taken_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_port_in_use_is_one_line_naming_port_and_flag(tmp_path: Path) -> None:
    with _taken_port() as holder:
        port = holder.getsockname()[1]
        line = _one_error(_serve("--in-memory", "--port", str(port), cwd=tmp_path))
    assert f"port {port}" in line and "--port" in line, line
    assert f"ss -ltnp 'sport = :{port}'" in line, line


def test_port_in_use_with_workers_is_one_line(tmp_path: Path) -> None:
    redis = RedisServer().start()
    try:
        with _taken_port() as holder:
            port = holder.getsockname()[1]
            result = _serve(
                "--backend", redis.url, "--workers", "2", "--port", str(port), cwd=tmp_path
            )
        line = _one_error(result)
    finally:
        redis.close()
    assert f"port {port}" in line and "--port" in line, line
