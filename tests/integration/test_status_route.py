"""``GET /v1/status`` and the page on a real server: behind the token like every route but
``/health``, served with the right content types, and on a quiet server the pools' numbers are
exactly those of ``/v1/pools``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from kvmeta.client.sglang import Hf3fsGlobalMetadataClient
from tests.support import InProcessServer, Server

TOKEN = "status-page-token"
AUTH = ("anyone", TOKEN)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    proc = InProcessServer("--in-memory", "--auth-token", TOKEN).start()
    try:
        yield proc
    finally:
        proc.stop()


def _get(server: Server, path: str, **kwargs: Any) -> requests.Response:
    return requests.get(server.url + path, timeout=30, **kwargs)


@pytest.mark.parametrize("path", ["/", "/ui", "/ui/status.js", "/ui/status.css", "/v1/status"])
def test_page_and_status_need_the_token(server: Server, path: str) -> None:
    refused = _get(server, path)
    assert refused.status_code == 401
    # one challenge per header line, Basic among them: a browser then asks for the token
    assert 'Basic realm="kvmeta"' in refused.headers["WWW-Authenticate"]
    assert _get(server, path, auth=("anyone", "wrong")).status_code == 401
    assert _get(server, path, auth=AUTH).status_code == 200
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert _get(server, path, headers=bearer).status_code == 200
    assert _get(server, "/health").status_code == 200  # still public


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/", "text/html"),
        ("/ui", "text/html"),
        ("/ui/status.js", "text/javascript"),
        ("/ui/status.css", "text/css"),
        ("/v1/status", "application/json"),
    ],
)
def test_content_types(server: Server, path: str, kind: str) -> None:
    resp = _get(server, path, auth=AUTH)
    assert resp.headers["Content-Type"].startswith(kind)
    if kind == "text/html":
        assert "<title>kvmeta status</title>" in resp.text


def _sample_after(server: Server, taken: int, timeout: float = 30.0) -> dict[str, Any]:
    """The status once the server has taken a sample after ``taken`` samples."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc: dict[str, Any] = _get(server, "/v1/status", auth=AUTH).json()
        if doc["history"]["taken"] > taken:
            return doc
        time.sleep(0.3)
    raise AssertionError(f"no status sample taken in {timeout}s")


def test_numbers_equal_pools_on_a_quiet_server(server: Server) -> None:
    client = Hf3fsGlobalMetadataClient(server.url, auth_token=TOKEN)
    for rank, ns in ((0, "kv"), (1, "kv"), (0, "other")):
        client.initialize(rank, 32, namespace=ns)
    keys = [f"k{i}" for i in range(10)]
    reserved = client.reserve_and_allocate_page_indices(0, [(k, None) for k in keys])
    pages = [page for _, page in reserved][:6]
    client.confirm_write(0, list(zip(keys[:6], pages, strict=True)), [])
    client.get_page_indices(0, keys)
    client.exists(1, ["nope"])
    taken = _get(server, "/v1/status", auth=AUTH).json()["history"]["taken"]
    status = _sample_after(server, taken + 1)  # two samples after the last change: rates too
    pools = _get(server, "/v1/pools", auth=AUTH).json()
    assert status["server"] == pools["server"]
    assert len(status["pools"]) == len(pools["pools"]) == 3
    for mine, theirs in zip(status["pools"], pools["pools"], strict=True):
        assert {k: mine[k] for k in theirs} == theirs
        assert mine["tenant"] == ""  # the default tenant (the page shows "-")
        assert mine["evictions_per_s"] == 0.0 and mine["refused_per_s"] == 0.0
    by_rank = {(p["rank"], p["namespace"]): p for p in status["pools"]}
    assert by_rank[(0, "kv")]["stored"] == 6 and by_rank[(0, "kv")]["reserved"] == 4
    assert by_rank[(0, "kv")]["hit_rate"] == 0.6
    backend = status["backend"]
    assert backend["describe"] == "memory" and backend["ready"] is True
    assert backend["epoch"] == pools["server"]["epoch"]
    history = status["history"]
    assert len(history["t"]) == len(history["p50_ms"]) == len(history["hit_ratio"]) >= 1
    assert any(name.endswith("/{rank}/get_page_indices") for name in history["rps"]) or any(
        history["p50_ms"]
    )
