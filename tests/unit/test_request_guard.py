"""``server.guard`` on a whole app, in process: which ``Host``, ``Origin`` and ``Content-Type``
each kind of server answers, that every route that may change state refuses a foreign origin
and a body not declared JSON while changing nothing, and the ``--allowed-hosts`` flag."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import msgspec
import pytest

from kvmeta.config import Settings, add_arguments, settings_from_args
from kvmeta.errors import ConfigError
from kvmeta.server.app import App
from kvmeta.server.guard import bound_to_loopback
from kvmeta.server.http import Request, Response
from kvmeta.server.runner import build_app
from kvmeta.service.ops import Service
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore

OWN = b"127.0.0.1:18000"


def make_app(**settings: Any) -> App:
    service = Service(LocalBackend(MemoryStore()))
    return build_app(Settings(in_memory=True, **settings), service)


def send(
    app: App,
    method: str,
    path: str,
    body: Any = b"",
    host: bytes | None = OWN,
    origin: bytes | None = None,
    ctype: bytes | None = None,
) -> Response:
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    request = Request(method, path, "", raw, None, None, host, origin, ctype)
    return asyncio.run(app(request))


def detail(response: Response) -> str:
    return str(msgspec.json.decode(response.body)["detail"])


def fill(app: App) -> None:
    """A stored key in SGLang pool (0, kv) and in vLLM rank 0."""
    assert send(app, "POST", "/0/initialize", {"num_pages": 4}).status == 204
    got = send(app, "POST", "/0/reserve_and_allocate_page_indices", {"keys": [["a", None]]})
    page = msgspec.json.decode(got.body)["indices"][0][1]
    confirm = {"written_keys_to_confirm": [["a", page]]}
    assert send(app, "POST", "/0/confirm_write", confirm).status == 204
    init = {"role": "worker", "num_pages": 4}
    assert send(app, "POST", "/rank/0/initialize", init).status == 200
    got = send(app, "POST", "/keys/batch_allocate", {"rank": 0, "keys": [["b", ""]]})
    confirmations = msgspec.json.decode(got.body)["results"]
    confirm = {"rank": 0, "confirmations": confirmations, "pages_to_release": []}
    assert send(app, "POST", "/keys/confirm_write", confirm).status == 204


def state(app: App) -> tuple[Any, ...]:
    s = send(app, "POST", "/0/exists", {"keys": ["a"]})
    v = send(app, "POST", "/keys/batch_exists", {"keys": ["b"]})
    registry = send(app, "GET", "/v1/vllm")
    return s.body, v.body, registry.body


# A body per route that, sent plainly, changes something (or would, for the reads).
BODIES: dict[str, Any] = {
    "/{rank}/clear": {},
    "/{rank}/delete_keys": {"keys": ["a"]},
    "/clear": b"",
    "/v1/vllm/ranks/{rank}/remove": b"",
    "/v1/vllm/world_size": {"world_size": 1},
}


def change_routes(app: App) -> list[tuple[str, str]]:
    routes = [(m, p) for m, p in app.routes() if m not in ("GET", "HEAD", "OPTIONS")]
    assert len(routes) >= 15 and ("POST", "/{rank}/clear") in routes
    return routes


@pytest.mark.parametrize(
    ("origin", "ctype"),
    [
        (b"http://evil.example", None),
        (b"null", None),
        (b"http://127.0.0.1:18001", b"application/json"),  # same host, another port
        (b"http://127.0.0.1", None),
        (None, b"text/plain"),
        (None, b"text/plain;charset=UTF-8"),
        (None, b"application/x-www-form-urlencoded"),
        (None, b"multipart/form-data; boundary=x"),
        (None, b"application/jsonx"),
    ],
)
def test_every_change_route_refuses_and_changes_nothing(
    origin: bytes | None, ctype: bytes | None
) -> None:
    app = make_app()
    fill(app)
    before = state(app)
    for method, pattern in change_routes(app):
        path = pattern.replace("{rank}", "0")
        got = send(app, method, path, BODIES.get(pattern, {}), origin=origin, ctype=ctype)
        if origin is not None:
            assert got.status == 403, (pattern, got.status, got.body)
            assert detail(got).startswith(f"Origin header '{origin.decode()}'"), detail(got)
        else:
            assert got.status == 415, (pattern, got.status, got.body)
            assert detail(got).startswith(f"Content-Type '{ctype.decode()}'")  # type: ignore[union-attr]
            assert "Content-Type: application/json" in detail(got)
    assert state(app) == before


@pytest.mark.parametrize(
    ("host", "origin"),
    [
        (OWN, b"http://127.0.0.1:18000"),
        (b"LocalHost:18000", b"http://localhost:18000"),
        (b"localhost", b"http://localhost:80"),
        (b"localhost:443", b"https://localhost"),
        (OWN, None),
        (None, None),
    ],
)
def test_same_origin_or_none_is_served(host: bytes | None, origin: bytes | None) -> None:
    app = make_app()
    fill(app)
    for ctype in (None, b"application/json", b"Application/JSON; charset=utf-8"):
        got = send(app, "POST", "/0/delete_keys", {"keys": ["a"]}, host, origin, ctype)
        assert got.status == 204, (ctype, got.body)


def test_reads_are_not_refused_for_their_origin() -> None:
    app = make_app()
    got = send(app, "GET", "/v1/pools", origin=b"http://evil.example", ctype=b"text/plain")
    assert got.status == 200


LOOPBACK_OK = [
    b"127.0.0.1:18000",
    b"127.9.9.9",
    b"localhost",
    b"localhost.:1",
    b"app.localhost:18000",
    b"[::1]:18000",
    b"[::ffff:127.0.0.1]:18000",
    b"",
]
LOOPBACK_REFUSED = [
    b"evil.example",
    b"evil.example:18000",
    b"127.0.0.1.evil.example",
    b"localhost.evil.example:18000",
    b"10.0.0.5:18000",
    b"[fd00::1]:18000",
    b"a b",
]
MALFORMED = [b"localhost:http", b"[::1", b"[::1]x", b"[evil.example]:1", b"localhost:18000:1"]


@pytest.mark.parametrize("host", LOOPBACK_OK)
def test_loopback_server_answers_loopback_names(host: bytes) -> None:
    assert send(make_app(), "GET", "/health", host=host).status == 200


@pytest.mark.parametrize("host", LOOPBACK_REFUSED)
def test_loopback_server_refuses_other_hosts(host: bytes) -> None:
    app = make_app()
    fill(app)
    before = state(app)
    for method, path in (("GET", "/v1/pools"), ("GET", "/health"), ("POST", "/0/clear")):
        got = send(app, method, path, host=host)
        assert got.status == 403, (path, got.body)
        assert detail(got).startswith(f"Host header '{host.decode()}'"), detail(got)
    assert "--allowed-hosts" in detail(got)
    assert state(app) == before


@pytest.mark.parametrize("host", MALFORMED)
def test_malformed_host_is_refused(host: bytes) -> None:
    got = send(make_app(host="0.0.0.0", allowed_hosts=("*.test",)), "GET", "/health", host=host)
    assert got.status == 403
    assert "is not a host name or address with an optional port" in detail(got)


def test_every_interface_accepts_any_host_unless_listed() -> None:
    app = make_app(host="0.0.0.0")
    for host in (b"evil.example:18000", b"kvmeta", b"10.0.0.5:18000"):
        assert send(app, "GET", "/health", host=host).status == 200
    app = make_app(host="0.0.0.0", allowed_hosts=("kvmeta.internal", "*.svc.test"))
    for host in (
        b"kvmeta.internal:18000",
        b"KVMETA.internal.",
        b"a.b.svc.test",
        b"10.0.0.5:18000",
        b"[fd00::1]:1",
        b"localhost",
    ):
        assert send(app, "GET", "/health", host=host).status == 200, host
    for host in (b"svc.test", b"evil.example", b"kvmeta.internal.evil.example", b"xsvc.test"):
        got = send(app, "GET", "/health", host=host)
        assert got.status == 403, host
        assert "kvmeta.internal, *.svc.test" in detail(got)


def test_allowed_hosts_extend_a_loopback_server() -> None:
    app = make_app(allowed_hosts=("kvmeta.test", "10.0.0.5"))
    for host in (b"kvmeta.test:18000", b"10.0.0.5:18000", b"localhost"):
        assert send(app, "GET", "/health", host=host).status == 200, host
    for host in (b"10.0.0.6", b"evil.example"):
        assert send(app, "GET", "/health", host=host).status == 403, host
    app = make_app(allowed_hosts=("*",))
    assert send(app, "GET", "/health", host=b"evil.example").status == 200


def test_refusals_are_counted_in_metrics() -> None:
    app = make_app()
    send(app, "GET", "/health", host=b"evil.example")
    send(app, "POST", "/0/clear", origin=b"http://evil.example")
    send(app, "POST", "/0/clear", ctype=b"text/plain")
    send(app, "POST", "/0/clear", ctype=b"text/plain")
    text = send(app, "GET", "/metrics").body.decode()
    assert 'kvmeta_requests_refused_total{header="host"} 1.0' in text
    assert 'kvmeta_requests_refused_total{header="origin"} 1.0' in text
    assert 'kvmeta_requests_refused_total{header="content_type"} 2.0' in text


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.5", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.1", False),
    ],
)
def test_bound_to_loopback(host: str, loopback: bool) -> None:
    assert bound_to_loopback(host) is loopback


def _settings(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from_args(parser.parse_args(argv), {})


def test_allowed_hosts_flag() -> None:
    given = "Kvmeta.Internal., *.svc.test, 10.0.0.1,[::1], *"
    assert _settings(["--allowed-hosts", given]).allowed_hosts == (
        "kvmeta.internal",
        "*.svc.test",
        "10.0.0.1",
        "::1",
        "*",
    )
    assert _settings([]).allowed_hosts is None
    for bad in ("http://kvmeta", "kvmeta:18000", "a b", "*.", "kv/meta", " , "):
        with pytest.raises(ConfigError) as info:
            _settings(["--allowed-hosts", bad])
        assert "`--allowed-hosts` (KVMETA_ALLOWED_HOSTS)" in str(info.value), bad
