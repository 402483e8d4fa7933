"""Test support: a real ``kvmeta serve`` subprocess on an ephemeral port."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import requests

from kvmeta.bench import procstat

SRC = Path(__file__).resolve().parents[1] / "src"
_LISTEN_RE = re.compile(r"kvmeta listening on (https?)://([^\s:]+|\[[^\]]+\]):(\d+)")


def wait_until(
    predicate: Callable[[], object], timeout: float = 30.0, what: str = "", interval: float = 0.01
) -> None:
    """Poll ``predicate`` until it is true: a test waits exactly as long as the condition takes,
    never a fixed sleep that is too long on a quiet machine and too short on a loaded one."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, (
            f"timed out after {timeout} s waiting for {what or predicate}"
        )
        time.sleep(interval)


def child_env() -> dict[str, str]:
    """The environment for a ``python -m kvmeta`` child: this checkout's source first on its
    path (installed or not), no ``KVMETA_*`` setting of the caller's, and no drain window on
    SIGTERM (a test that wants one passes ``--drain-seconds``, which wins over the variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMETA_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["KVMETA_DRAIN_SECONDS"] = "0"
    return env


class ServerProcess:
    """``kvmeta serve`` in a child process; ``url`` is set once it listens.

    Its stderr goes to an unnamed file, not a pipe: whatever the server logged before it
    answered a request is in ``log`` when the answer arrives (a thread draining a pipe could
    still be behind on a loaded machine).
    """

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, cwd: str | Path | None = None
    ) -> None:
        self.args = list(args)
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.port = 0
        self._stderr = -1  # a file descriptor

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def log(self) -> str:
        if self._stderr < 0:
            return ""
        return os.pread(self._stderr, 1 << 30, 0).decode(errors="replace")

    @property
    def lines(self) -> list[str]:
        return self.log.splitlines(keepends=True)

    def start(self, timeout: float = 20.0) -> ServerProcess:
        args = list(self.args)
        if "--port" not in args:
            args += ["--port", "0"]
        env = child_env()
        env.update(self.env or {})
        if self._stderr < 0:
            self._stderr, path = tempfile.mkstemp(prefix="kvmeta-serve-", suffix=".log")
            os.unlink(path)
            weakref.finalize(self, os.close, self._stderr)
        else:
            os.ftruncate(self._stderr, 0)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmeta", "serve", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            text=True,
            env=env,
            cwd=self.cwd,
        )
        self.url = ""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _LISTEN_RE.search(self.log)
            if match:
                host = match.group(2)
                self.port = int(match.group(3))
                self.url = f"{match.group(1)}://{host}:{self.port}"
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvmeta serve exited with {self.proc.returncode}:\n{self.log}")
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"kvmeta serve did not start within {timeout}s:\n{self.log}")

    def wait_for_log(self, needle: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.log:
                return
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} not in server log:\n{self.log}")

    def post(self, path: str, body: Any = None, **kwargs: Any) -> requests.Response:
        if body is not None and not isinstance(body, (bytes, str)):
            return requests.post(self.url + path, json=body, timeout=30, **kwargs)
        return requests.post(self.url + path, data=body, timeout=30, **kwargs)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal the server and wait for it; returns its exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise AssertionError(f"server ignored {sig} for {timeout}s:\n{self.log}") from None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def cpu_seconds(self) -> float:
        """CPU time of the server (and the processes it started) so far."""
        return procstat.cpu_seconds(self.pid)


def until_released(server: ServerProcess, timeout: float = 60.0) -> None:
    """Until no pool of a restarted server holds pages for the previous run's leases any
    more (``held_after_restart``: the pages it kept from new writers after the restart)."""
    deadline = time.monotonic() + timeout
    while True:
        pools = requests.get(server.url + "/v1/pools", timeout=30).json()["pools"]
        if not any(p.get("held_after_restart") for p in pools):
            return
        assert time.monotonic() < deadline, f"pages still held after {timeout} s: {pools}"
        time.sleep(0.1)


def unused_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A loopback URL that accepts connections and never answers (to test client timeouts)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        for conn in accepted:
            conn.close()
        listener.close()


def kvmeta_check(data: Path) -> subprocess.CompletedProcess[str]:
    """``kvmeta check --data-dir data`` in another process, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", "check", "--data-dir", str(data)],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
    )


def self_signed_cert(directory: Path, name: str = "") -> tuple[Path, Path]:
    """A fresh self-signed certificate for 127.0.0.1/localhost and its key (PEM, unencrypted),
    made by the ``openssl`` command."""
    cert, key = directory / f"{name}cert.pem", directory / f"{name}key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key
