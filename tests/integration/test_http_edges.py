"""The connection layer under clients that do not play along.

Each test runs a real ``kvmeta serve`` and talks raw sockets to it.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import requests

from tests.support import ServerProcess

Make = Callable[..., ServerProcess]
TOKEN = "s3cret"


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def _peak_mib(server: ServerProcess) -> float:
    """The server's peak resident memory so far (VmHWM), which no later drop can hide."""
    return _status_kib(server.pid, "VmHWM") / 1024


def _connect(server: ServerProcess) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.port))
    return sock


def _read_all(sock: socket.socket, limit: float = 30.0) -> bytes:
    """Everything the server sends until it closes (or ``limit`` seconds pass)."""
    sock.settimeout(limit)
    data = b""
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _store(server: ServerProcess, keys: list[str], headers: dict[str, str] | None = None) -> None:
    kw = {"headers": headers or {}, "timeout": 60}
    for i in range(0, len(keys), 1000):
        batch = keys[i : i + 1000]
        got = requests.post(
            server.url + "/0/reserve_and_allocate_page_indices",
            json={"keys": [[k, ""] for k in batch]},
            **kw,
        ).json()["indices"]
        done = requests.post(
            server.url + "/0/confirm_write",
            json={
                "written_keys_to_confirm": [[k, p] for k, (_, p) in zip(batch, got, strict=True)]
            },
            **kw,
        )
        assert done.status_code == 204, done.text


def test_public_routes_take_no_body_and_nothing_is_read_before_the_token(
    make_server: Make,
) -> None:
    server = make_server("--in-memory", "--auth-token", TOKEN)
    # A token-less request announcing a body: 401 at the headers, no 100 Continue.
    sock = _connect(server)
    sock.sendall(
        b"POST /0/initialize HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n"
        b"Expect: 100-continue\r\n\r\n"
    )
    reply = _read_all(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in reply, reply[:300]
    # A body to /health (public: served without the token) is refused at the headers too.
    sock = _connect(server)
    sock.sendall(
        b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 16777216\r\n"
        b"Expect: 100-continue\r\n\r\n"
    )
    reply = _read_all(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in reply, reply[:300]
    assert b"/health" in reply and b"body" in reply
    # Bodies sent anyway are dropped as they come, never held: several at once stay flat.
    requests.get(server.url + "/health", timeout=10)
    before = _peak_mib(server)

    def send() -> None:
        with contextlib.suppress(OSError), _connect(server) as conn:
            conn.sendall(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 16777216\r\n\r\n")
            conn.sendall(b"x" * (16777216 - 1))  # all but the last byte: never complete
            _read_all(conn, 10)

    senders = [threading.Thread(target=send, daemon=True) for _ in range(8)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(60)
    grown = _peak_mib(server) - before
    assert grown < 40, f"server memory grew {grown:.0f} MiB for bodies sent to /health"
    assert requests.get(server.url + "/health", timeout=10).ok


def test_an_upgrade_request_is_refused_before_it_runs(make_server: Make) -> None:
    server = make_server("--in-memory")
    requests.post(server.url + "/0/initialize", json={"num_pages": 8}, timeout=10)
    _store(server, ["a"])
    for head in (
        b"POST /0/clear HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Content-Length: 2\r\n\r\n{}",
        b"CONNECT 127.0.0.1:443 HTTP/1.1\r\nHost: 127.0.0.1:443\r\n\r\n",
    ):
        sock = _connect(server)
        sock.sendall(head)
        reply = _read_all(sock)
        sock.close()
        # one reply, not a reply and then an error
        assert len(re.findall(rb"HTTP/1\.1 \d{3} ", reply)) == 1, reply
        assert reply.startswith(b"HTTP/1.1 400 ") and b"Upgrade" in reply, reply
    exists = requests.post(server.url + "/0/exists", json={"keys": ["a"]}, timeout=10)
    assert exists.json() == {"exists": [True]}  # the clear never ran
