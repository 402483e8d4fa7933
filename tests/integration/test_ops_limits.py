"""Every request limit end to end: a 413/400 naming the limit and the flag that raises it, and
nothing changed by the rejected request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import requests

from tests.support import Server


@pytest.fixture
def server(app_server: Server) -> Server:
    """Every test here checks what requests get back: the server runs in this process."""
    return app_server


N = 16


@pytest.fixture
def small(make_app: Callable[..., Server]) -> Server:
    server = make_app(
        "--in-memory",
        "--max-body-bytes",
        "2000",
        "--max-keys",
        "8",
        "--max-key-length",
        "70",
        "--max-namespace-length",
        "12",
        "--max-pages",
        "1000",
    )
    assert server.post("/0/initialize", {"num_pages": N}).status_code == 204
    return server


def pools(server: Server) -> list[dict[str, Any]]:
    resp = requests.get(server.url + "/v1/pools", timeout=10)
    assert resp.status_code == 200
    return [
        {k: p[k] for k in ("dialect", "rank", "namespace", "free", "reserved", "stored")}
        for p in resp.json()["pools"]
    ]


def rejected(resp: requests.Response, status: int, *needles: str) -> None:
    assert resp.status_code == status, resp.text
    detail = resp.json()["detail"]
    for needle in needles:
        assert needle in detail, detail


def test_body_size_limit_413_names_flag(small: Server) -> None:
    before = pools(small)
    body = {"keys": [["k" * 60 + str(i), None] for i in range(40)]}  # > 2000 bytes
    rejected(small.post("/0/reserve_and_allocate_page_indices", body), 413, "--max-body-bytes")
    # a chunked body over the limit is caught while reading, too
    chunks = iter([b'{"keys": [' + b'"x",' * 600, b'"y"]}'])
    resp = requests.post(small.url + "/0/exists", data=chunks, timeout=10)
    rejected(resp, 413, "--max-body-bytes")
    assert pools(small) == before


def test_keys_per_request_limit_413(small: Server) -> None:
    before = pools(small)
    keys = [f"k{i}" for i in range(9)]
    rejected(small.post("/0/exists", {"keys": keys}), 413, "--max-keys", "9")
    rejected(
        small.post("/0/reserve_and_allocate_page_indices", {"keys": [[k, None] for k in keys]}),
        413,
        "--max-keys",
    )
    rejected(small.post("/0/get_page_indices", {"keys": keys}), 413, "--max-keys")
    rejected(small.post("/0/delete_keys", {"keys": keys}), 413, "--max-keys")
    body = {"written_keys_to_confirm": [["a", 0]] * 5, "pages_to_release": [1, 2, 3, 4]}
    rejected(small.post("/0/confirm_write", body), 413, "--max-keys", "pages_to_release")
    assert pools(small) == before
    # at the limit it works
    ok = small.post("/0/reserve_and_allocate_page_indices", {"keys": [[k, None] for k in keys[:8]]})
    assert ok.status_code == 200 and len(ok.json()["indices"]) == 8


def test_key_length_limit_400_and_nothing_reserved(small: Server) -> None:
    before = pools(small)
    body = {"keys": [["ok-key", None], ["x" * 71, None]]}
    rejected(small.post("/0/reserve_and_allocate_page_indices", body), 400, "--max-key-length")
    rejected(small.post("/0/exists", {"keys": ["y" * 71]}), 400, "--max-key-length", "71")
    confirm = {"written_keys_to_confirm": [["z" * 71, 0]]}
    rejected(small.post("/0/confirm_write", confirm), 400, "--max-key-length")
    assert pools(small) == before  # the valid first key was not reserved either


def test_namespace_limits_400(small: Server) -> None:
    before = pools(small)
    long_ns = {"num_pages": 8, "namespace": "n" * 13}
    rejected(small.post("/0/initialize", long_ns), 400, "--max-namespace-length", "namespace")
    bad_chars = {"num_pages": 8, "namespace": "a b/c"}
    rejected(small.post("/0/initialize", bad_chars), 400, "namespace", "letters, digits")
    rejected(small.post("/0/initialize", {"num_pages": 8, "namespace": ""}), 400, "namespace")
    assert pools(small) == before


def test_num_pages_limit_400(small: Server) -> None:
    before = pools(small)
    rejected(small.post("/1/initialize", {"num_pages": 1001}), 400, "--max-pages", "1000")
    rejected(small.post("/1/initialize", {"num_pages": 0}), 400, "num_pages")
    rejected(small.post("/1/initialize", {"num_pages": -5}), 400, "num_pages")
    assert pools(small) == before
    assert small.post("/1/initialize", {"num_pages": 1000}).status_code == 204


def test_defaults_are_logged_and_generous(server: Server) -> None:
    server.wait_for_log("limits: max_body_bytes=16777216 max_keys=65536")
    assert server.post("/0/initialize", {"num_pages": 4096}).status_code == 204
    keys = [f"{i:064x}" for i in range(2048)]
    resp = server.post("/0/reserve_and_allocate_page_indices", {"keys": [[k, None] for k in keys]})
    assert resp.status_code == 200 and len(resp.json()["indices"]) == 2048
