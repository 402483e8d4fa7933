"""``kvmeta bench``: the measured window opens only once every client process runs, a run
that measured nothing is an error rather than a table of ``-``, and a token in ``--url`` is
used, never shown.

Real processes throughout (the bench command, its client processes, the servers they drive).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvmeta.bench.driver import BenchConfig, run_bench
from kvmeta.errors import KvmetaError
from tests.support import SRC, ServerProcess, unused_port

ROOT = Path(__file__).resolve().parents[2]
_ENV = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}


def _bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_ENV,
        cwd=ROOT,
    )


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kvmeta: error:")]


def test_every_client_is_up_before_the_window_opens() -> None:
    # Eight spawned client processes take longer to start on a small machine than this warm-up
    # and window together: the window must wait for them, not open on an idle server.
    proc = _bench(
        *("--launch", "memory", "--clients", "8", "--duration", "0.5", "--warmup", "0"),
        *("--pool-pages", "1024", "--batch", "16", "--json"),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["requests"] > 0
    per_client = report["client_requests"]
    assert len(per_client) == 8
    assert min(per_client) > 0, per_client
    assert sum(per_client) == report["requests"]


def test_a_run_that_measured_nothing_fails_with_one_line() -> None:
    # Poisson arrivals at 1e-9 requests/s: the chance of one in the half-second window is
    # about 5e-10, so the window measures nothing.
    proc = _bench(
        *("--launch", "memory", "--clients", "2", "--rate", "1e-9", "--duration", "0.5"),
        *("--warmup", "0", "--pool-pages", "1024"),
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""  # no table of "-"
    [error] = _errors(proc.stderr)
    assert "no request" in error and "--rate" in error, proc.stderr


def _request(conn: socket.socket, buf: bytes) -> tuple[str, bytes] | None:
    """The next request's first line off ``conn`` (None when it closed), and what is left."""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    head, _, buf = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(buf) < length:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    return lines[0], buf[length:]


@contextlib.contextmanager
def setup_only_server() -> Iterator[str]:
    """A loopback URL that answers a benchmark's set-up (initialize; no ``/v1/pools``) and
    never answers the cycle's requests: no client gets its first answer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    conns: list[socket.socket] = []

    def serve(conn: socket.socket) -> None:
        buf = b""
        with contextlib.suppress(OSError):
            while (got := _request(conn, buf)) is not None:
                line, buf = got
                if line.startswith("POST /0/initialize "):
                    conn.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
                elif line.startswith("GET /v1/pools "):
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                else:
                    return  # held open, never answered

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                conns.append(conn)
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for conn in conns:
            conn.close()


def test_clients_that_never_get_a_first_answer_fail_the_run_naming_how_many_started() -> None:
    with setup_only_server() as url:
        cfg = BenchConfig(
            url=url, clients=2, prefill=False, warmup=0.0, duration=0.5, start_timeout=2.0
        )
        with pytest.raises(KvmetaError, match=r"0 of 2 benchmark clients started") as info:
            run_bench(cfg)
    assert "\n" not in str(info.value)


def test_the_url_password_is_the_token_and_is_never_shown(
    make_server: Callable[..., ServerProcess],
) -> None:
    token = "pw" + secrets.token_hex(8)
    server = make_server("--in-memory", "--read-lease", "0", "--auth-token", token)
    url = server.url.replace("://", f"://:{token}@")
    common = ("--url", url, "--clients", "1", "--requests", "40", "--warmup", "0")
    for extra in ((), ("--json",)):
        proc = _bench(*common, "--pool-pages", "1024", *extra)
        assert proc.returncode == 0, proc.stderr.replace(token, "<token>")
        assert token not in proc.stdout and token not in proc.stderr
    report = json.loads(proc.stdout)
    assert report["requests"] >= 40
    assert report["config"]["auth_token"] == "(set)"
    # Errors that show the URL show it without the token.
    port = unused_port()
    for bad, shown in (
        (f"http://:{token}@127.0.0.1:{port}", f"nothing answers at http://127.0.0.1:{port}"),
        (f"https://:{token}@127.0.0.1:1", "'https://:***@127.0.0.1:1'"),  # not plain HTTP
    ):
        proc = _bench("--url", bad, "--requests", "8", timeout=60)
        assert proc.returncode != 0
        assert token not in proc.stdout and token not in proc.stderr, proc.stderr
        [error] = _errors(proc.stderr)
        assert shown in error, error
    # A launched server's flags are shown with the token left out.
    proc = _bench(
        *("--launch", "memory", "--auth-token", token, "--requests", "40", "--warmup", "0"),
        *("--pool-pages", "1024", "--json"),
    )
    assert proc.returncode == 0, proc.stderr.replace(token, "<token>")
    assert token not in proc.stdout and token not in proc.stderr
    assert "--auth-token=***" in json.loads(proc.stdout)["config"]["server_args"]
