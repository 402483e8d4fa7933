"""Hostile connections: half-sent requests, huge headers, unauthenticated bodies, idle sockets.

Each test runs a real ``kvmeta serve`` and talks raw sockets to it, because the point is what
the server does with bytes a well-behaved client would never send.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from tests.support import ServerProcess

Make = Callable[..., ServerProcess]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _connect(server: ServerProcess, timeout: float = 30.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    return sock


def _read_reply(sock: socket.socket, limit: float = 30.0) -> bytes:
    """Everything the server sends until it closes (or ``limit`` seconds pass)."""
    sock.settimeout(limit)
    data = b""
    with contextlib.suppress(ConnectionResetError, TimeoutError, socket.timeout):
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def test_a_96_mb_header_value_is_431_without_buffering_it(make_server: Make) -> None:
    server = make_server("--in-memory")
    requests.get(server.url + "/health", timeout=10)  # warm up before measuring
    before = _rss_kib(server.pid)
    sock = _connect(server)
    sent = [0]

    def send() -> None:
        chunk = b"a" * (1 << 20)
        with contextlib.suppress(OSError):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
            for _ in range(96):
                sock.sendall(chunk)
                sent[0] += len(chunk)

    sender = threading.Thread(target=send, daemon=True)
    started = time.monotonic()
    sender.start()
    reply = _read_reply(sock)
    took = time.monotonic() - started
    sender.join(30)
    sock.close()
    grown_mib = (_rss_kib(server.pid) - before) / 1024
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert b"exceed" in reply
    assert grown_mib < 20, f"server RSS grew {grown_mib:.1f} MiB"
    assert took < 20
    assert requests.get(server.url + "/health", timeout=10).ok


def test_no_token_no_100_continue_and_no_body_read(make_server: Make) -> None:
    server = make_server("--in-memory", "--auth-token", "s3cret")
    requests.get(server.url + "/health", timeout=10)
    before = _rss_kib(server.pid)
    sock = _connect(server)
    sock.sendall(
        b"POST /0/initialize HTTP/1.1\r\nHost: localhost\r\nContent-Length: 16777216\r\n"
        b"Expect: 100-continue\r\n\r\n"
    )
    reply = _read_reply(sock)  # the server closes after its answer: nothing else comes
    sock.close()
    assert reply.startswith(b"HTTP/1.1 401 "), reply[:200]
    assert b"100 Continue" not in reply
    assert b"www-authenticate" in reply.lower()
    # Without Expect, the body is sent anyway: it is dropped, not buffered.
    sock = _connect(server)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(_read_reply(sock)), daemon=True)
    reader.start()
    with contextlib.suppress(OSError):
        sock.sendall(
            b"POST /0/initialize HTTP/1.1\r\nHost: localhost\r\nContent-Length: 16777216\r\n\r\n"
        )
        sock.sendall(b"x" * 16777216)
    reader.join(30)
    sock.close()
    assert got and got[0].startswith(b"HTTP/1.1 401 "), got
    grown_mib = (_rss_kib(server.pid) - before) / 1024
    assert grown_mib < 12, f"server RSS grew {grown_mib:.1f} MiB"
    ok = requests.post(
        server.url + "/0/initialize",
        json={"num_pages": 4},
        headers={"Authorization": "Bearer s3cret"},
    )
    assert ok.status_code == 204


def test_header_and_idle_timeouts(make_server: Make) -> None:
    server = make_server("--in-memory", "--header-timeout", "1", "--idle-timeout", "2")
    slow = _connect(server)
    slow.sendall(b"POST /0/exists HTTP/1.1\r\nHost: localhost\r\n")  # ...and never the rest
    silent = _connect(server)  # connects, sends nothing
    idle = _connect(server)
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert idle.recv(65536).startswith(b"HTTP/1.1 200 ")
    started = time.monotonic()
    reply = _read_reply(slow)
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert b"--header-timeout" in reply
    assert _read_reply(silent) == b""
    assert time.monotonic() - started < 15
    assert _read_reply(idle) == b""  # closed after --idle-timeout
    assert time.monotonic() - started >= 1.0
    for sock in (slow, silent, idle):
        sock.close()


def test_connections_beyond_the_cap_are_closed_at_once_with_a_warning(make_server: Make) -> None:
    server = make_server("--in-memory", "--max-connections", "4")
    held = []
    for _ in range(4):
        sock = _connect(server)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        held.append(sock)
    extra = _connect(server)
    with contextlib.suppress(OSError):
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert _read_reply(extra, 10) == b""
    extra.close()
    server.wait_for_log("--max-connections")
    held.pop().close()
    deadline = time.monotonic() + 20
    while True:  # a slot is free again once the server saw the close
        try:
            if requests.get(server.url + "/health", timeout=5).ok:
                break
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for sock in held:
        sock.close()


@contextlib.contextmanager
def _nofile_for_children(limit: int) -> Iterator[None]:
    """Processes started inside get an open-file limit of ``limit``; this one keeps its own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
@pytest.mark.soak
def test_a_flood_of_half_sent_requests_cannot_starve_the_journal(
    tmp_path: Path,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    data = tmp_path / "data"
    args = ("--data-dir", str(data), "--header-timeout", "3", "--snapshot-interval", "1")
    with _nofile_for_children(256):
        server = ServerProcess(*args, cwd=tmp_path).start()
    flood: list[socket.socket] = []
    try:
        server.wait_for_log("--max-connections lowered from 4096 to 192")
        for _ in range(1100):
            try:
                sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
                sock.sendall(b"POST /0/exists HTTP/1.1\r\nHost: localhost\r\nContent-Le")
            except OSError:
                continue
            flood.append(sock)
        # Beyond half the cap, each new connection closed the oldest one that had sent no
        # whole request yet.
        server.wait_for_log("to make room for new ones", timeout=30)
        # A normal client gets through and its confirms reach the journal.
        keys = [f"k{i}" for i in range(50)]
        deadline = time.monotonic() + 60
        while True:
            try:
                resp = requests.post(
                    server.url + "/0/initialize", json={"num_pages": 64}, timeout=10
                )
                if resp.status_code == 204:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, server.log
            time.sleep(0.2)
        got = server.post("/0/reserve_and_allocate_page_indices", {"keys": [[k, ""] for k in keys]})
        pages = [p for _, p in got.json()["indices"]]
        done = server.post(
            "/0/confirm_write",
            {"written_keys_to_confirm": [[k, p] for k, p in zip(keys, pages, strict=True)]},
        )
        assert done.status_code == 204
        # The slow sockets were answered 408 (the last half-cap of them) or closed unanswered
        # to make room (the others).
        replies = [_read_reply(sock, 30) for sock in flood]
        assert sum(r.startswith(b"HTTP/1.1 408 ") for r in replies) >= 50
        assert all(r == b"" or r.startswith(b"HTTP/1.1 408 ") for r in replies)
        assert "Too many open files" not in server.log
        assert server.stop() == 0, server.log
    finally:
        for sock in flood:
            sock.close()
        server.kill()
    again = ServerProcess(*args, cwd=tmp_path).start()
    try:
        assert again.post("/0/exists", {"keys": keys}).json()["exists"] == [True] * len(keys)
    finally:
        again.stop()


def test_a_pipelined_request_without_token_is_refused_behind_a_waiting_one(
    make_server: Make, tmp_path: Path
) -> None:
    server = make_server(
        "--data-dir", str(tmp_path / "d"), "--fsync", "always", "--auth-token", "s3cret"
    )
    body = b'{"num_pages": 4}'
    first = (
        b"POST /0/initialize HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer s3cret\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    second = b"POST /1/initialize HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    sock = _connect(server)
    sock.sendall(first + second)  # the first waits for its fsync while the second is parsed
    reply = _read_reply(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 204 "), reply
    assert b"HTTP/1.1 401 " in reply, reply
    auth = {"Authorization": "Bearer s3cret"}
    resp = requests.post(server.url + "/1/exists", json={"keys": ["a"]}, headers=auth, timeout=10)
    assert resp.status_code == 404  # never initialised
