"""The server refuses what a browser driven by another site's page sends: a Host
that names no loopback address of a loopback-bound server (DNS rebinding), a change from a
foreign Origin, a change whose body is not declared JSON. Each refusal changes nothing; the
same request without the offending header goes through."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from typing import Any

import pytest
import requests

from tests.support import Server


@pytest.fixture
def server(app_server: Server) -> Server:
    """Every test here checks what requests get back: the server runs in this process."""
    return app_server


TOKEN = "guard-token"


def fill(server: Server, **kw: Any) -> None:
    assert server.post("/0/initialize", {"num_pages": 4}, **kw).status_code == 204
    got = server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None]]}, **kw)
    page = got.json()["indices"][0][1]
    confirm = {"written_keys_to_confirm": [["a", page]]}
    assert server.post("/0/confirm_write", confirm, **kw).status_code == 204


def stored(server: Server, **kw: Any) -> list[bool]:
    exists: list[bool] = server.post("/0/exists", {"keys": ["a"]}, **kw).json()["exists"]
    return exists


def test_rebound_host_is_refused_by_a_loopback_server(server: Server) -> None:
    fill(server)
    evil = {"Host": f"evil.example:{server.port}"}
    r = requests.get(server.url + "/v1/pools", headers=evil, timeout=10)
    assert r.status_code == 403
    text = r.json()["detail"]
    assert text.startswith(f"Host header 'evil.example:{server.port}' is not accepted"), text
    assert "bound to 127.0.0.1" in text and "--allowed-hosts" in text and "rebinding" in text
    r = server.post("/0/clear", {}, headers=evil)
    assert r.status_code == 403 and stored(server) == [True]
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"):
        assert requests.get(server.url + "/health", headers={"Host": host}, timeout=10).ok
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    assert 'kvmeta_requests_refused_total{header="host"} 2.0' in metrics


def test_allowed_hosts_names_more_hosts(make_app: Callable[..., Server]) -> None:
    server = make_app("--in-memory", "--allowed-hosts", "kvmeta.test,*.svc.test")
    for host, ok in (("kvmeta.test", True), ("a.svc.test", True), ("evil.example", False)):
        r = requests.get(server.url + "/health", headers={"Host": f"{host}:1"}, timeout=10)
        assert r.ok is ok, (host, r.text)
    r = requests.get(server.url + "/health", headers={"Host": "evil.example"}, timeout=10)
    assert "--allowed-hosts lists kvmeta.test, *.svc.test" in r.json()["detail"]


def test_foreign_origin_cannot_change_even_with_the_login(
    make_app: Callable[..., Server],
) -> None:
    # A browser that holds the operator's login sends it along with another site's form.
    server = make_app("--in-memory", "--auth-token", TOKEN)
    login = ("operator", TOKEN)
    fill(server, auth=login)
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{server.port + 1}"):
        r = server.post("/0/clear", {}, auth=login, headers={"Origin": origin})
        assert r.status_code == 403, r.text
        assert r.json()["detail"].startswith(f"Origin header '{origin}' is not this server's")
    r = server.post("/0/clear", b"{}", auth=login, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "Content-Type 'text/plain'" in r.json()["detail"]
    # No token: 401 first, on the headers.
    r = server.post("/0/clear", {}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 401
    assert stored(server, auth=login) == [True]
    # The server's own origin, and none, are served; reads from anywhere too.
    own = {"Origin": server.url}
    assert requests.get(server.url + "/v1/pools", auth=login, headers=own, timeout=10).ok
    r = requests.get(
        server.url + "/v1/pools", auth=login, headers={"Origin": "http://x"}, timeout=10
    )
    assert r.ok
    assert server.post("/0/exists", {"keys": ["a"]}, auth=login, headers=own).ok
    assert server.post("/0/clear", {}, auth=login).status_code == 204
    assert stored(server, auth=login) == [False]


def _head_only(server: Server, headers: bytes) -> bytes:
    """Send a POST's headers announcing a body (``Expect: 100-continue``), never the body, and
    read what the server sends until it closes the connection (at most 20 s)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(
            b"POST /0/initialize HTTP/1.1\r\nContent-Length: 1000\r\n"
            b"Expect: 100-continue\r\n" + headers + b"\r\n"
        )
        data = b""
        with contextlib.suppress(ConnectionResetError, TimeoutError):
            while chunk := sock.recv(65536):
                data += chunk
        return data


def test_refusals_come_at_the_headers_before_the_body(
    make_server: Callable[..., Server],
) -> None:
    # A long --header-timeout: a server waiting for the body would not answer within the read.
    server = make_server("--in-memory", "--header-timeout", "120", "--access-log")
    own = b"Host: localhost:%d\r\n" % server.port
    cases = (
        (own + b"Content-Type: text/plain\r\n", b"415", b"Content-Type 'text/plain'"),
        (own + b"Origin: http://evil.example\r\n", b"403", b"Origin header"),
        (b"Host: evil.example:%d\r\n" % server.port, b"403", b"Host header"),
    )
    for headers, status, detail in cases:
        reply = _head_only(server, headers)
        # Answered and closed without the body, and without inviting it (no 100 Continue).
        assert reply.startswith(b"HTTP/1.1 " + status + b" "), reply[:300]
        assert b"100 Continue" not in reply and detail in reply, reply[:300]
        assert b"connection: close" in reply.lower(), reply[:300]
    pools = requests.get(server.url + "/v1/pools", timeout=10).json()["pools"]
    assert pools == []  # nothing was initialized
    # Refused before the app, yet in the access log like any reply.
    server.wait_for_log("POST /0/initialize 415 ")
    assert server.log.count("POST /0/initialize 403 ") == 2, server.log
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    for header in ("host", "origin", "content_type"):
        assert f'kvmeta_requests_refused_total{{header="{header}"}} 1.0' in metrics
