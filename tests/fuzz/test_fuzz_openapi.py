"""Fuzz a real ``kvmeta serve`` from its own OpenAPI document: thousands of generated and
malformed requests; fail on any 5xx, any answer the document does not describe, or a broken
page invariant afterwards (``/v1/check``)."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.schema import Call, Schema
from tests.support import ServerProcess

pytestmark = pytest.mark.slow

FLAGS = ("--in-memory", "--max-pages", "4096", "--max-keys", "64", "--reservation-ttl", "0.5")
BATCHES = 250  # x up to 24 requests each: ~3,000 requests


def send(session: requests.Session, url: str, call: Call) -> requests.Response:
    return session.request(call.method, url + call.path, data=call.body, timeout=30)


@pytest.mark.soak
def test_generated_and_malformed_requests(make_server: Callable[..., ServerProcess]) -> None:
    server = make_server(*FLAGS)
    session = requests.Session()
    doc = session.get(server.url + "/openapi.json", timeout=10).json()
    schema = Schema(doc)
    # Pools to hit, so most generated requests reach the page logic instead of a 404.
    for rank in ("0", "1", "-1", "2"):
        for ns in ("kv", "mamba"):
            body = {"num_pages": 16, "namespace": ns}
            assert session.post(f"{server.url}/{rank}/initialize", json=body).status_code == 204
    sent = 0

    @settings(
        max_examples=BATCHES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(schema.calls(), min_size=1, max_size=24))
    def run(calls: list[Call]) -> None:
        nonlocal sent
        for call in calls:
            resp = send(session, server.url, call)
            sent += 1
            schema.check(call, resp.status_code, resp.headers.get("content-type", ""), resp.content)

    try:
        run()
        check = session.get(server.url + "/v1/check", timeout=60).json()
        assert check["ok"], check["problems"]
        assert check["checked"] >= 8
    finally:
        session.close()
    assert sent >= 1000, sent
    assert "Traceback" not in server.log, server.log


def test_raw_garbage_never_5xx(make_server: Callable[..., ServerProcess]) -> None:
    server = make_server(*FLAGS)
    host, port = server.url.split("://", 1)[1].rsplit(":", 1)
    statuses: list[int] = []

    @settings(max_examples=300, deadline=None, database=None)
    @given(
        head=st.sampled_from(
            [
                b"POST /0/exists HTTP/1.1\r\nHost: localhost\r\n",
                b"POST /0/exists HTTP/1.1\r\nContent-Length: 5\r\n\r\n",
                b"POST /0/exists HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                b"GET /health HTTP/1.1\r\n",
                b"",
            ]
        ),
        junk=st.binary(max_size=200),
    )
    def run(head: bytes, junk: bytes) -> None:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head + junk)
            sock.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        for line in reply.split(b"\r\n"):
            if line.startswith(b"HTTP/1.1 "):
                status = int(line.split(b" ", 2)[1])
                statuses.append(status)
                assert status < 500, (head + junk, reply)

    run()
    assert any(400 <= s < 500 for s in statuses)
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert requests.get(server.url + "/v1/check", timeout=10).json()["ok"]
