"""``kvmeta serve --backend redis://...`` start-up: a bad URL or a Redis that refuses the
connection set-up stops the server with a message that names the cause, never a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests

from tests.redis_support import RedisServer
from tests.support import SRC, ServerProcess


def _start_fails(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Start ``kvmeta serve ARGS``, expect it to exit 2, return its log."""
    server = ServerProcess(*args, env=env, cwd=tmp_path)
    try:
        with pytest.raises(RuntimeError) as info:
            server.start()
    finally:
        server.kill()
    assert server.proc is not None and server.proc.returncode == 2, str(info.value)
    text = str(info.value)
    assert "Traceback" not in text, text
    return text


def test_a_database_redis_does_not_have_reports_redis_answer(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    text = _start_fails(tmp_path, "--backend", f"{redis_server.url}/99")
    assert "cannot reach" not in text
    assert "DB index is out of range" in text  # Redis's own answer
    assert "/99" in text and "databases" in text  # the URL part and the setting to check


def test_a_wrong_password_reports_redis_answer(tmp_path: Path) -> None:
    own = RedisServer(password="right").start()
    try:
        text = _start_fails(tmp_path, "--backend", f"redis://:wrong@127.0.0.1:{own.port}/0")
    finally:
        own.close()
    assert "cannot reach" not in text
    assert "invalid username-password pair" in text and "password in the URL" in text
    assert "wrong" not in text.replace("WRONGPASS", "")  # the password itself stays out


@pytest.mark.parametrize(
    ("tail", "names"),
    [("/abc", "/abc"), ("/0x1", "/0x1"), ("/1/2", "/1/2"), ("/-1", "/-1"), ("/0?db=two", "db=two")],
)
def test_a_database_that_is_not_a_number_is_refused(
    redis_server: RedisServer, tmp_path: Path, tail: str, names: str
) -> None:
    text = _start_fails(tmp_path, "--backend", redis_server.url + tail)
    assert names in text and "database" in text


@pytest.mark.parametrize("param", ["ssl_ca_certs", "ssl_certfile", "ssl_keyfile"])
def test_a_missing_tls_file_is_named(redis_server: RedisServer, tmp_path: Path, param: str) -> None:
    missing = tmp_path / "nowhere" / f"{param}.pem"
    url = f"rediss://127.0.0.1:{redis_server.port}/0?{param}={missing}"
    text = _start_fails(tmp_path, "--backend", url)
    assert f"{param}={missing}" in text and "not found" in text


def test_the_redis_backend_reports_no_data_directory(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    server = ServerProcess("--backend", redis_server.url, cwd=tmp_path).start()
    try:
        server.wait_for_log("state: ")
        pools = requests.get(server.url + "/v1/pools", timeout=10).json()
    finally:
        server.stop()
    assert "kvmeta-data" not in server.log
    assert "kvmeta-data" not in str(pools["server"]), pools["server"]
    assert pools["server"]["durability"] == "redis"
    assert not (tmp_path / "kvmeta-data").exists()


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--data-dir", "state"], {}),
        (["--in-memory"], {}),
        ([], {"KVMETA_DATA_DIR": "state"}),
    ],
)
def test_a_data_directory_with_a_redis_backend_is_refused(
    redis_server: RedisServer, tmp_path: Path, args: list[str], env: dict[str, str]
) -> None:
    text = _start_fails(tmp_path, "--backend", redis_server.url, *args, env=env)
    assert "--backend" in text and ("--data-dir" in text or "--in-memory" in text), text


def test_a_missing_redis_extra_names_the_install_command(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Without hiredis (part of the `[redis]` extra) the server stops at start-up naming the
    extra, not with a traceback."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "hiredis.py").write_text("raise ImportError('No module named hiredis')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(SRC), str(blocked)])}
    text = _start_fails(tmp_path, "--backend", redis_server.url, env=env)
    assert "pip install 'kvmeta[redis]'" in text and "hiredis" in text
