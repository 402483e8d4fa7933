"""The connection layer under clients that do not play along: pipelining without reading the
replies, silent TLS connections, bodies sent to public routes, token-less connections held open,
and protocol upgrades.

Each test runs a real ``kvmeta serve`` and talks raw sockets to it.
"""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import msgspec
import pytest
import requests

from tests.support import Server, self_signed_cert

Make = Callable[..., Server]
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def _peak_mib(server: Server) -> float:
    """The server's peak resident memory so far (VmHWM), which no later drop can hide."""
    return _status_kib(server.pid, "VmHWM") / 1024


def _connect(server: Server, rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:  # a small receive window: replies pile up in the server, not in this kernel
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
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


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes ``sock`` within ``seconds`` (whatever it sent first)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _read_response(stream: BinaryIO) -> tuple[int, bytes]:
    """One response (status, body) from a keep-alive stream; bodies carry Content-Length."""
    status = int(stream.readline().split()[1])
    length = 0
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, stream.read(length)


def _get(sock: socket.socket, path: str, token: bool = False) -> bytes:
    auth = f"Authorization: Bearer {TOKEN}\r\n" if token else ""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n{auth}\r\n".encode())
    return sock.recv(65536)


def _store(server: Server, keys: list[str], headers: dict[str, str] | None = None) -> None:
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


@pytest.mark.slow
@pytest.mark.soak
def test_pipelined_replies_nobody_reads_stay_bounded(make_server: Make) -> None:
    server = make_server("--in-memory")
    requests.post(server.url + "/0/initialize", json={"num_pages": 16384}, timeout=30)
    keys = [f"{i:05d}" + "k" * 500 for i in range(10000)]
    _store(server, keys)
    assert len(requests.get(server.url + "/v1/dump?rank=0&limit=10000", timeout=30).content) > (
        5_000_000
    )
    count = 100  # 100 replies of ~5 MB each: ~500 MB if the server kept them all
    sock = _connect(server, rcvbuf=4096)
    before = _peak_mib(server)
    sock.sendall(
        b"".join(
            b"GET /v1/dump?rank=0&limit=%d HTTP/1.1\r\nHost: localhost\r\n\r\n" % (10000 - i)
            for i in range(count)
        )
    )
    # Other clients are answered meanwhile (and by then the server has seen the pipeline).
    for _ in range(5):
        assert requests.get(server.url + "/health", timeout=10).ok
    grown = _peak_mib(server) - before
    assert grown < 100, f"server memory grew {grown:.0f} MiB for replies nobody read"
    # Reading the socket now gets every reply, in order.
    stream = sock.makefile("rb")
    for i in range(count):
        status, body = _read_response(stream)
        assert status == 200
        assert len(msgspec.json.decode(body)["keys"]) == 10000 - i
    stream.close()
    sock.close()


def test_silent_connections_to_a_tls_port_time_out(make_server: Make, tmp_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    server = make_server(
        "--in-memory",
        "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
        "--header-timeout", "1",
    )  # fmt: skip
    silent = [_connect(server) for _ in range(3)]  # no TLS handshake, nothing at all
    for sock in silent:
        assert _closed_within(sock, 20), "a silent TLS connection outlived --header-timeout"
        sock.close()
    assert requests.get(server.url + "/health", verify=str(cert), timeout=10).ok


def test_silent_connections_to_a_tls_port_count_against_the_cap(
    make_server: Make, tmp_path: Path
) -> None:
    cert, key = self_signed_cert(tmp_path)
    server = make_server(
        "--in-memory",
        "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
        "--max-connections", "4", "--header-timeout", "60",
    )  # fmt: skip
    silent = [_connect(server) for _ in range(4)]
    # At most half the cap may be connections that showed no token: the two oldest silent
    # ones made room for the next two (they were counted from accept, before any handshake).
    assert _closed_within(silent[0], 20) and _closed_within(silent[1], 20)
    server.wait_for_log("--max-connections")
    # A real client still gets in (and the engines' connections could not be locked out).
    assert requests.get(server.url + "/health", verify=str(cert), timeout=10).ok
    for sock in silent:
        sock.close()


def test_public_routes_take_no_body_and_nothing_is_read_before_the_token(
    make_server: Make,
) -> None:
    server = make_server("--in-memory", "--auth-token", TOKEN)
    # A token-less request announcing a body: 401 at the headers, no 100 Continue.
    sock = _connect(server)
    sock.sendall(
        b"POST /0/initialize HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000000\r\n"
        b"Expect: 100-continue\r\n\r\n"
    )
    reply = _read_all(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in reply, reply[:300]
    # A body to /health (public: served without the token) is refused at the headers too.
    sock = _connect(server)
    sock.sendall(
        b"POST /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: 16777216\r\n"
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
            conn.sendall(
                b"POST /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: 16777216\r\n\r\n"
            )
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


def test_a_token_less_connection_gets_the_short_idle_timeout(make_server: Make) -> None:
    server = make_server("--in-memory", "--auth-token", TOKEN, "--header-timeout", "1")
    anon = _connect(server)
    assert _get(anon, "/health").startswith(b"HTTP/1.1 200 ")
    engine = _connect(server)
    assert _get(engine, "/v1/pools", token=True).startswith(b"HTTP/1.1 200 ")
    # No valid token seen: closed after --header-timeout, not kept for --idle-timeout (300 s).
    assert _closed_within(anon, 20)
    assert _get(engine, "/v1/pools", token=True).startswith(b"HTTP/1.1 200 ")
    anon.close()
    engine.close()


def test_token_less_connections_get_half_the_cap_and_engines_still_connect(
    make_server: Make,
) -> None:
    server = make_server(
        "--in-memory", "--auth-token", TOKEN, "--max-connections", "4", "--header-timeout", "60"
    )
    engines = [_connect(server) for _ in range(2)]
    for sock in engines:
        assert _get(sock, "/v1/pools", token=True).startswith(b"HTTP/1.1 200 ")
    anon = []
    for _ in range(6):  # probes without the token, kept open
        sock = _connect(server)
        with contextlib.suppress(OSError):
            _get(sock, "/health")
        anon.append(sock)
    # Another engine connects: a token-less connection makes room, not an engine.
    resp = requests.get(server.url + "/v1/pools", headers=AUTH, timeout=10)
    assert resp.status_code == 200
    for sock in engines:  # the engines' connections were kept
        assert _get(sock, "/v1/pools", token=True).startswith(b"HTTP/1.1 200 ")
    still_open = [sock for sock in anon if not _closed_within(sock, 0.5)]
    assert len(still_open) <= 2, "more than half of --max-connections without a token"
    for sock in engines + anon:
        sock.close()


def test_an_upgrade_request_is_refused_before_it_runs(make_app: Make) -> None:
    server = make_app("--in-memory")
    requests.post(server.url + "/0/initialize", json={"num_pages": 8}, timeout=10)
    _store(server, ["a"])
    for head in (
        b"POST /0/clear HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nContent-Length: 2\r\n\r\n{}",
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


def test_tls_clients_still_work_with_tls_started_per_connection(
    make_server: Make, tmp_path: Path
) -> None:
    cert, key = self_signed_cert(tmp_path)
    server = make_server(
        "--in-memory", "--auth-token", TOKEN,
        "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
    )  # fmt: skip
    with requests.Session() as session:
        kw = {"verify": str(cert), "timeout": 10}  # (a Session's own verify yields to env vars)
        assert session.post(server.url + "/0/initialize", json={"num_pages": 8}, headers=AUTH, **kw)
        for _ in range(3):  # keep-alive over one TLS connection
            resp = session.post(server.url + "/0/exists", json={"keys": ["a"]}, headers=AUTH, **kw)
            assert resp.json() == {"exists": [False]}
        assert session.get(server.url + "/v1/pools", **kw).status_code == 401
    # A large reply over TLS arrives whole.
    context = ssl.create_default_context(cafile=str(cert))
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(
                b"GET /openapi.json HTTP/1.1\r\nHost: localhost\r\n"
                b"Authorization: Bearer s3cret\r\n\r\n"
            )
            status, body = _read_response(tls.makefile("rb"))
    assert status == 200 and msgspec.json.decode(body)["openapi"]
