"""Dialect S over HTTP: every route, status code, shape and error."""

from __future__ import annotations

import socket

import pytest
import requests

from tests.support import Server


@pytest.fixture
def server(app_server: Server) -> Server:
    """Every test here checks what requests get back: the server runs in this process."""
    return app_server


NOT_INIT = "Rank {r} namespace '{ns}' not initialized. Please call /{r}/initialize first."


def init(server: Server, rank: int = 0, n: int = 8, ns: str | None = None) -> None:
    body: dict[str, object] = {"num_pages": n}
    if ns is not None:
        body["namespace"] = ns
    resp = server.post(f"/{rank}/initialize", body)
    assert resp.status_code == 204, resp.text
    assert resp.content == b""


def test_full_cycle_with_exact_shapes(server: Server) -> None:
    init(server)
    r = server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None], ["b", "a"]]})
    assert r.status_code == 200 and r.json() == {"indices": [[False, 0], [False, 1]]}
    r = server.post(
        "/0/confirm_write", {"written_keys_to_confirm": [["a", 0]], "pages_to_release": [1]}
    )
    assert r.status_code == 204 and r.content == b""
    assert server.post("/0/exists", {"keys": ["a", "b"]}).json() == {"exists": [True, False]}
    assert server.post("/0/get_page_indices", {"keys": ["b", "a"]}).json() == {"indices": [None, 0]}
    r = server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None]]})
    assert r.json() == {"indices": [[True, 0]]}
    assert server.post("/0/delete_keys", {"keys": ["a"]}).status_code == 204
    assert server.post("/0/exists", {"keys": ["a"]}).json() == {"exists": [False]}


def test_namespaces_are_separate_pools(server: Server) -> None:
    init(server, 0, 4)
    init(server, 0, 4, ns="mamba")
    server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None]]})
    server.post("/0/confirm_write", {"written_keys_to_confirm": [["a", 0]]})
    assert server.post("/0/exists", {"keys": ["a"]}).json() == {"exists": [True]}
    r = server.post("/0/exists", {"keys": ["a"], "namespace": "mamba"})
    assert r.json() == {"exists": [False]}
    r = server.post("/0/exists", {"keys": ["a"], "namespace": "indexer"})
    assert r.status_code == 404
    assert r.json() == {"detail": NOT_INIT.format(r=0, ns="indexer")}


@pytest.mark.parametrize(
    "op",
    [
        "exists",
        "reserve_and_allocate_page_indices",
        "confirm_write",
        "get_page_indices",
        "delete_keys",
        "clear",
    ],
)
def test_uninitialised_pool_is_404_with_exact_message(server: Server, op: str) -> None:
    body = {"keys": [["k", None]]} if op.startswith("reserve") else {"keys": ["k"]}
    if op in ("confirm_write", "clear"):
        body = {}
    r = server.post(f"/3/{op}", body)
    assert r.status_code == 404
    assert r.json() == {"detail": NOT_INIT.format(r=3, ns="kv")}


def test_ranks_parse_like_the_reference(server: Server) -> None:
    init(server, -1, 2)
    init(server, 7, 2)
    assert server.post("/007/exists", {"keys": []}).json() == {"exists": []}
    assert server.post("/-1/exists", {"keys": []}).json() == {"exists": []}
    for bad in ("x", "1.5", "1_0", "%20"):
        r = server.post(f"/{bad}/exists", {"keys": []})
        assert r.status_code == 422, bad
        assert "rank" in r.json()["detail"]


def test_clear_accepts_empty_body_and_keeps_pool(server: Server) -> None:
    init(server, 0, 2)
    server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None]]})
    server.post("/0/confirm_write", {"written_keys_to_confirm": [["a", 0]]})
    r = requests.post(server.url + "/0/clear", timeout=10)  # no body at all
    assert r.status_code == 204
    assert server.post("/0/exists", {"keys": ["a"]}).json() == {"exists": [False]}
    assert server.post("/0/clear", {}).status_code == 204
    assert server.post("/0/clear", {"namespace": "kv"}).status_code == 204


def test_reinitialise_with_other_size_keeps_pool_and_warns(server: Server) -> None:
    init(server, 0, 2)
    init(server, 0, 2)  # idempotent
    init(server, 0, 5)  # misconfiguration: 204 for old clients, but the pool keeps 2 pages
    r = server.post(
        "/0/reserve_and_allocate_page_indices", {"keys": [["a", None], ["b", None], ["c", None]]}
    )
    assert r.json() == {"indices": [[False, 0], [False, 1], [False, -1]]}
    server.wait_for_log("re-initialised with num_pages=5 but has 2 pages")


def test_only_json_bodies_are_read(server: Server) -> None:
    init(server, 0, 2)
    r = server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None]]})
    server.post("/0/confirm_write", {"written_keys_to_confirm": [["a", r.json()["indices"][0][1]]]})
    body = b'{"keys": ["a"]}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        r = requests.post(
            server.url + "/0/delete_keys", data=body, headers={"Content-Type": ctype}, timeout=10
        )
        assert r.status_code == 415, r.text
        assert f"Content-Type '{ctype}' is not accepted" in r.json()["detail"]
        assert "application/json" in r.json()["detail"]
    assert server.post("/0/exists", {"keys": ["a"]}).json() == {"exists": [True]}
    for headers in ({"Content-Type": "Application/JSON; charset=utf-8"}, {}):
        r = requests.post(server.url + "/0/exists", data=body, headers=headers, timeout=10)
        assert r.status_code == 200 and r.json() == {"exists": [True]}, (headers, r.text)


BAD_BODIES = [
    ("initialize", b"{", "not valid JSON"),
    ("initialize", b"[1]", "Expected `object`"),
    ("initialize", b"{}", "num_pages"),
    ("initialize", b'{"num_pages": 0}', "num_pages"),
    ("initialize", b'{"num_pages": -4}', "num_pages"),
    ("initialize", b'{"num_pages": "8"}', "num_pages"),
    ("initialize", b'{"num_pages": 1.5}', "num_pages"),
    ("initialize", b'{"num_pages": true}', "num_pages"),
    ("initialize", b'{"num_pages": 8, "namespace": 3}', "namespace"),
    ("initialize", b'{"num_pages": 8, "namespace": ""}', "namespace"),
    ("initialize", b'{"num_pages": 99999999999999}', "num_pages"),
    ("exists", b'{"keys": "abc"}', "keys"),
    ("exists", b'{"keys": [1, 2]}', "keys"),
    ("exists", b"{}", "keys"),
    ("exists", b"null", "Expected `object`"),
    ("reserve_and_allocate_page_indices", b'{"keys": ["a"]}', "keys"),
    ("reserve_and_allocate_page_indices", b'{"keys": [["a"]]}', "keys"),
    ("reserve_and_allocate_page_indices", b'{"keys": [["a", "b", "c"]]}', "keys"),
    ("reserve_and_allocate_page_indices", b'{"keys": [[1, null]]}', "keys"),
    ("confirm_write", b'{"written_keys_to_confirm": [["a"]]}', "written_keys_to_confirm"),
    ("confirm_write", b'{"written_keys_to_confirm": [["a", "0"]]}', "written_keys_to_confirm"),
    ("confirm_write", b'{"written_keys_to_confirm": [["a", 99]]}', "written_keys_to_confirm"),
    ("confirm_write", b'{"written_keys_to_confirm": [["a", -1]]}', "written_keys_to_confirm"),
    ("confirm_write", b'{"pages_to_release": [8]}', "pages_to_release"),
    ("confirm_write", b'{"pages_to_release": [-1]}', "pages_to_release"),
    ("confirm_write", b'{"pages_to_release": "0"}', "pages_to_release"),
    ("get_page_indices", b'{"keys": [null]}', "keys"),
    ("delete_keys", b'{"keys": {"a": 1}}', "keys"),
    ("clear", b'{"namespace": 5}', "namespace"),
]


@pytest.mark.parametrize(("op", "body", "needle"), BAD_BODIES)
def test_failure12_malformed_bodies_are_4xx_and_change_nothing(
    server: Server, op: str, body: bytes, needle: str
) -> None:
    init(server, 0, 8)
    server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None]]})
    r = server.post(f"/0/{op}", body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.status_code in (400, 413, 422)
    detail = r.json()["detail"]
    assert needle in detail, detail
    # nothing changed: a is still reserved on page 0 and can be confirmed; page 1 is next
    r = server.post("/0/reserve_and_allocate_page_indices", {"keys": [["a", None], ["b", None]]})
    assert r.json() == {"indices": [[False, 0], [False, 1]]}


def test_unknown_route_and_wrong_method(server: Server) -> None:
    r = server.post("/0/nope", {})
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    r = server.post("/a/b/c/d", {})
    assert r.status_code == 404
    r = requests.get(server.url + "/0/exists", timeout=10)
    assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"}


def test_oversize_body_is_413(make_app: object) -> None:
    server = make_app("--in-memory", "--max-body-bytes", "1000")  # type: ignore[operator]
    r = server.post("/0/initialize", b'{"num_pages": 8, "pad": "' + b"x" * 2000 + b'"}')
    assert r.status_code == 413
    assert "--max-body-bytes" in r.json()["detail"]


def _raw(server: Server, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(payload)
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)


def test_http_pipelining_chunked_and_garbage(server: Server) -> None:
    init(server, 0, 4)
    body = b'{"keys": ["a"]}'
    one = b"POST /0/exists HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    chunked = (
        b"POST /0/exists HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n"
        b'Connection: close\r\n\r\n5\r\n{"key\r\na\r\ns": ["a"]}\r\n0\r\n\r\n'
    )
    out = _raw(server, one + one + chunked)
    assert out.count(b"HTTP/1.1 200 OK") == 3
    assert out.count(b'{"exists":[false]}') == 3
    out = _raw(server, b"GARBAGE\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400")


def test_many_connections_keep_alive(server: Server) -> None:
    init(server, 0, 64)
    with requests.Session() as s:
        for i in range(50):
            r = s.post(
                server.url + "/0/reserve_and_allocate_page_indices",
                json={"keys": [[f"k{i}", None]]},
                timeout=10,
            )
            assert r.status_code == 200
            page = r.json()["indices"][0][1]
            s.post(
                server.url + "/0/confirm_write",
                json={"written_keys_to_confirm": [[f"k{i}", page]]},
                timeout=10,
            )
        r = s.post(
            server.url + "/0/exists", json={"keys": [f"k{i}" for i in range(50)]}, timeout=10
        )
        assert r.json() == {"exists": [True] * 50}
